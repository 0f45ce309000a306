"""``relayrl doctor RUN_DIR [--step N]``: where the generator–trainer gap of a run comes from.

Training saves a small record every ``logging.doctor_every`` steps (``record.py``); ``diagnose``
(``replay.py``) rescores that step's tokens at the same weights with one cause toggled at a time
and attributes the observed gap to each (docs/mismatch.md).
"""
