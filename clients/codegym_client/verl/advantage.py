"""Advantage estimators that leave out the rows with nothing to train on. Imports verl (and torch)
when `register()` runs, not at import.

`CodeGymAgentLoop` hands verl a row an infrastructure fault ended with a response mask of zeros:
verl multiplies every loss term by that mask, so the row gives no gradient. What the mask does not
reach is its group: verl's group estimators compute the baseline of a prompt's rollouts (same
`uid`) from every row's score, masked or not (`compute_grpo_outcome_advantage`,
verl/trainer/ppo/core_algos.py, and the rest of the registry alike), so the failed row's 0 would
still shift the mean and std that every other rollout of its prompt is measured against. verl has
no field that takes a row out of its group, but it has a registry of estimators
(`core_algos.register_adv_est`, looked up by `algorithm.adv_estimator` in `compute_advantage`).

`register()` adds, for each of verl's group estimators below, `codegym_<name>`: verl's own
estimator run on the rows that have at least one token to train on (response mask not all zero),
every other row getting advantage and return 0. The kept rows' advantages are exactly what verl
computes for a batch in which the dropped rows had never been sampled; e.g. with
`algorithm.adv_estimator=codegym_grpo`, a group of 8 with one failure is normalised over its 7
other rollouts, and a group left with one rollout gets verl's rule for a group of one (mean 0,
std 1: its advantage is its score). A row whose whole mask verl's own sequence-level rejection
sampling zeroed (`algorithm.rollout_correction`) is left out the same way.

verl computes advantages in its driver (`TaskRunner`, a Ray actor), not in the rollout workers
that import the agent loop, so the registry must be filled there: give Ray this module's
`register` as the job's worker setup hook (it runs in every worker process of the job), as
examples/verl/train_grpo.sh does:

    ++ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=codegym_client.verl.advantage.register
    algorithm.adv_estimator=codegym_grpo
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["GROUPED", "PREFIX", "dropping", "register"]

log = logging.getLogger(__name__)

PREFIX = "codegym_"
# verl's estimators that measure a row against the other rows of its group (`index`, the uid) and
# that verl's `compute_advantage` calls through its registry with what it gives any registered
# name (token_level_rewards, response_mask, config, index). Not wrapped: GAE (its own branch in
# compute_advantage, with values; its whitening is masked already), REMAX and the optimal token
# baselines (verl passes their extra inputs only under their own names).
GROUPED = (
    "grpo",
    "grpo_vectorized",
    "grpo_passk",
    "rloo",
    "rloo_vectorized",
    "reinforce_plus_plus_baseline",
    "gpg",
    "opo",
)


def dropping(estimator: Callable[..., Any]) -> Callable[..., Any]:
    """`estimator` (one of verl's, called with keyword arguments) run on the rows whose response
    mask is not all zero; the other rows get advantage and return 0."""
    # verl's stack, not the client's: imported when an estimator is wrapped (the client's import
    # fence, tests/test_client_install.py, admits them here).
    import numpy
    import torch

    takes_norm = "norm_adv_by_std_in_grpo" in inspect.signature(estimator).parameters

    def rows_of(value: Any, rows: Any, batch: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
            return value[rows]
        if isinstance(value, numpy.ndarray) and value.ndim > 0 and value.shape[0] == batch:
            return value[rows.cpu().numpy()]
        return value

    def estimate(token_level_rewards: Any, response_mask: Any, **kwargs: Any) -> tuple[Any, Any]:
        config = kwargs.get("config")
        if takes_norm and "norm_adv_by_std_in_grpo" not in kwargs and config is not None:
            # verl passes it by name to its own GRPO only; others read the algorithm config.
            kwargs["norm_adv_by_std_in_grpo"] = bool(config.get("norm_adv_by_std_in_grpo", True))
        kept = response_mask.sum(dim=-1) > 0
        if bool(kept.all()):
            return estimator(token_level_rewards=token_level_rewards, response_mask=response_mask, **kwargs)
        advantages = torch.zeros_like(token_level_rewards)
        returns = torch.zeros_like(token_level_rewards)
        if bool(kept.any()):
            rows = kept.nonzero(as_tuple=True)[0]
            batch = int(response_mask.shape[0])
            part = {name: rows_of(value, rows, batch) for name, value in kwargs.items()}
            kept_advantages, kept_returns = estimator(
                token_level_rewards=token_level_rewards[rows], response_mask=response_mask[rows], **part
            )
            advantages[rows] = kept_advantages.to(advantages.dtype)
            returns[rows] = kept_returns.to(returns.dtype)
        log.debug("advantages: %d of %d rows left out (no token to train on)", int((~kept).sum()), len(kept))
        return advantages, returns

    estimate.codegym_drops_rows = True  # type: ignore[attr-defined]
    estimate.__name__ = f"{PREFIX}{getattr(estimator, '__name__', 'estimator')}"
    estimate.__doc__ = (
        f"verl's {getattr(estimator, '__name__', 'estimator')} on the rows with a token to train on."
    )
    return estimate


def register() -> list[str]:
    """Register `codegym_<name>` for each of `GROUPED` that this verl has; returns the names.
    Idempotent. Without verl (a Ray worker of another stack), registers nothing."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as exc:
        log.warning("verl is not importable here; no CodeGym advantage estimator registered: %s", exc)
        return []
    registry: dict[str, Any] = core_algos.ADV_ESTIMATOR_REGISTRY
    names = []
    for name in GROUPED:
        base = registry.get(name)
        if base is None:
            continue
        ours = f"{PREFIX}{name}"
        existing = registry.get(ours)
        if existing is not None and not getattr(existing, "codegym_drops_rows", False):
            raise ValueError(
                f"advantage estimator {ours!r} is registered already, not by CodeGym: {existing}"
            )
        registry.pop(ours, None)
        core_algos.register_adv_est(ours)(dropping(base))
        names.append(ours)
    return names
