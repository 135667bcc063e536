"""Tiering: the KV tiers below the device pool (host, disk, Redis), codecs, and residency policy.

One concept per module: :mod:`~memos_ref.tiering.store` / :mod:`~memos_ref.tiering.backends` /
:mod:`~memos_ref.tiering.codecs` / :mod:`~memos_ref.tiering.blockfile` (where blocks live below the device),
:mod:`~memos_ref.tiering.policies` (eviction priorities), :mod:`~memos_ref.tiering.manager` (watermarks, pins, the
step, stats, the thread driver; :class:`~memos_ref.tiering.manager.PressureRelief` is what the session layer
implements), :mod:`~memos_ref.tiering.swap` (swap-out, write-back, swap-in), :mod:`~memos_ref.tiering.costs`
(reload-or-recompute), :mod:`~memos_ref.tiering.prefetch` (the Markov predictor and prefetch),
:mod:`~memos_ref.tiering.simulate` (policies on traces, with the sessions' token layout) and
:mod:`~memos_ref.tiering.metrics` (Prometheus).
"""
