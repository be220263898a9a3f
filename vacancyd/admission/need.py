"""The footprint a request is charged: one rule, for admission, the vacancy probe and
`vacancyd footprint` alike, so that what the CLI prints is what admission charges.

1. A model with its own `models."M".need_mib` is charged exactly that: the operator
   measured it, and it replaces `default_need_mib` entirely.
2. Otherwise, per resource, what vacancyd found (`FootprintHint`): what real loads of the
   model were measured to take on this machine, else what its geometry estimates (on
   the upstream's primary resource).
3. `default_need_mib` is a floor under what was found: a model without its own entry is
   never charged less than the default on a resource the default names, and is charged
   more where a measurement or an estimate says it needs more. An operator who wrote a
   default meant "at least this much for a model I did not list"; an estimate that
   silently charged less would lend memory the operator kept back. To let measurements
   and estimates charge less, lower the default (or leave that resource out of it).

Pure: no I/O, so the rule is a table test.
"""

from __future__ import annotations

from collections.abc import Mapping

from vacancyd.config.schema import ResourceConfig, UpstreamConfig
from vacancyd.model import FootprintHint, ModelNeed

CONFIGURED = "configured"
DEFAULT = "default"


def need_for(
    upstream: UpstreamConfig,
    resources: Mapping[str, ResourceConfig],
    model: str | None,
    hint: FootprintHint | None = None,
) -> ModelNeed:
    """The request's footprint on each budgeted resource, and where each number came
    from (see the module docstring for the order)."""
    table, sources, notes = _charge(upstream, model, hint)
    budgeted = {
        name: mib
        for name, mib in table.items()
        if name in resources and resources[name].kind.has_bytes
    }
    kept = {name: sources[name] for name in budgeted}
    detail = "; ".join(notes[name] for name in budgeted if notes.get(name))
    if hint is not None and hint.detail and any(s != DEFAULT for s in kept.values()):
        detail = f"{detail}; {hint.detail}" if detail else hint.detail
    primary = kept.get(upstream.resource) or next(iter(kept.values()), None)
    return ModelNeed(
        model=model,
        need_mib=budgeted,
        resident_min_free_mib=upstream.resident_min_free_mib,
        source=primary or (CONFIGURED if _configured(upstream, model) else DEFAULT),
        sources=kept,
        detail=detail,
    )


def _configured(upstream: UpstreamConfig, model: str | None) -> bool:
    return model is not None and model in upstream.models


def _charge(
    upstream: UpstreamConfig, model: str | None, hint: FootprintHint | None
) -> tuple[dict[str, int], dict[str, str], dict[str, str]]:
    """(MiB, source, note for the operator) per resource."""
    if model is not None and model in upstream.models:
        configured = dict(upstream.models[model].need_mib)
        return configured, dict.fromkeys(configured, CONFIGURED), {}
    found = dict(hint.need_mib) if hint is not None else {}
    default = upstream.default_need_mib
    table: dict[str, int] = {}
    sources: dict[str, str] = {}
    notes: dict[str, str] = {}
    for name in [*default, *(n for n in found if n not in default)]:
        floor, mib = default.get(name), found.get(name)
        if mib is None or hint is None:
            assert floor is not None
            table[name], sources[name] = floor, DEFAULT
            continue
        source = hint.source_of(name)
        if floor is not None and floor > mib:
            table[name], sources[name] = floor, DEFAULT
            notes[name] = f"{name}: the default {floor} MiB, a floor above the {source} {mib} MiB"
        else:
            table[name], sources[name] = mib, source
            notes[name] = f"{name}: {source} {mib} MiB"
    return table, sources, notes
