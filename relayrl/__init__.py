"""relayrl: asynchronous RL for LLM post-training — fast to use, fast to read, fast to execute."""

__version__ = "0.1.0"
