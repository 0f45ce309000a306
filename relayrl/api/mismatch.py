"""``actor.rollout_correction``: importance-sampling corrections for the generator–trainer gap
(truncated IS / masked IS), one option that composes with every policy loss (docs/mismatch.md)."""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.api.fields import f


@dataclass
class RolloutCorrectionConfig:
    mode: str = f(
        "off",
        help="Reweight each loss token by w = pi_trainer / pi_generator (the trainer's logprob before the update over "
        "the generator's): 'truncate' (TIS) clamps w to [low, high]; 'mask' (MIS, IcePop) drops tokens or sequences "
        "whose w is outside [low, high]; 'off' applies nothing. The weight multiplies the token's advantage, so it "
        "composes with ppo, gspo, reinforce, decoupled_ppo (whose own behaviour weight it replaces) and any loss "
        "linear in the advantage; the ratio's old logprobs then come from the trainer (actor.recompute_logp is taken "
        "as true).",
        choices=["off", "truncate", "mask"],
    )
    level: str = f(
        "token",
        help="One weight per token, per sequence (the product of its token ratios: verl, TRL) or per sequence as the "
        "geometric mean of its token ratios ('geometric': length-independent bounds).",
        choices=["token", "sequence", "geometric"],
    )
    high: float = f(2.0, help="Upper bound on w (truncate: clamp; mask: drop above).", gt=1.0, le=1e6)
    low: float | None = f(
        None,
        help="Lower bound on w; None = none for truncate (verl / TRL), 1 / high for mask (verl).",
        ge=0.0,
        lt=1.0,
    )
    masked_in_norm: bool = f(
        False,
        help="mask: dropped tokens still count in the loss's normaliser with weight 0 (TRL) instead of leaving it "
        "(verl's rejection sampling).",
    )
