"""The daemon's documents in words for a person: what `vacancyd status` and `vacancyd
holds` print.

Apart from cli.py because it is a different job: cli.py parses arguments and talks to the
daemon; this turns a /status document (the JSON the daemon publishes, not its objects)
into lines, and needs nothing but that document. It is the half of the command line that
changes whenever /status gains a field, and a test can render any document it holds.
"""

from __future__ import annotations

from typing import Any


def holds_of(document: dict[str, Any]) -> dict[str, Any]:
    """The durable holds in a status document: held jobs, and an untrusted holds file."""
    held = [
        {"upstream": name, **job}
        for name, upstream in document["upstreams"].items()
        for job in upstream["active_work"]
        if job["phase"] == "held"
    ]
    unreadable = next((f for f in document.get("state_files", []) if f["kind"] == "holds"), None)
    return {"jobs": held, "unreadable_file": unreadable}


def render_holds(holds: dict[str, Any]) -> str:
    """The holds for a person: the untrusted file first, since it refuses everything."""
    lines = []
    unreadable = holds["unreadable_file"]
    if unreadable is not None:
        lines.append(
            f"holds file {unreadable['path']} {unreadable['reason']}: every resource "
            f"refuses ({', '.join(unreadable['resources'])}); "
            "clear it with `vacancyd release --unreadable-file`"
        )
    for job in holds["jobs"]:
        lines.append(
            f"job {job['job_id']} on {job['upstream']} holds {', '.join(job['resources'])} "
            f"since {job.get('held_since') or '?'}: {job.get('hold_reason') or ''}"
        )
    return "\n".join(lines) or "no durable holds"


def render_status(document: dict[str, Any]) -> str:
    """The status document for a person: one line per fact that decides admission."""
    lines = [
        f"vacancyd {document.get('version', '?')}: "
        f"{'ready' if document.get('ready') else 'NOT READY'}, "
        f"lending {_lending_words(document['lending'])}",
        *_hours_lines(document.get("lending_hours")),
    ]
    presence = document["presence"]
    lines.append(
        f"presence: {presence['backend']} · {presence.get('session') or 'no reading'} · "
        f"{presence['quality']}{_age(presence.get('age_s'))}"
        + (
            f" · refuses {presence['refuses']}: {presence['refusal_detail']}"
            if presence.get("refuses")
            else ""
        )
    )
    if presence.get("scope"):
        lines.append(f"  {presence['scope']}")
    if presence.get("decided_by"):
        lines.append(f"  decided by {presence['decided_by']}")
    for held in presence.get("idle_inhibitors") or []:
        lines.append(f"  idle inhibitor: {held}")
    power, sleep = document.get("power"), document.get("sleep")
    if power and power.get("read"):
        battery = "on battery" if power.get("on_battery") else "on mains power"
        refuses = " · refuses on_battery" if power.get("refuses") else ""
        lines.append(f"power: {battery}{refuses}")
    if sleep and sleep.get("going_to_sleep"):
        lines.append("sleep: the machine is going to sleep: nothing is lent")
    veto = document["owner_veto"]
    lines.append(
        f"owner veto: {'ENGAGED (' + veto['reason'] + ')' if veto['engaged'] else 'clear'}"
    )
    lines.append("resources:")
    for name, resource in document["resources"].items():
        reading = f"{resource['quality']}{_age(resource.get('age_s'))}"
        facts = [resource["kind"], f"{reading} from {resource.get('source', '?')}"]
        if resource.get("free_bytes") is not None:
            facts.append(f"{resource['free_bytes'] // (1024 * 1024)} MiB free")
        if resource.get("utilization_pct") is not None:
            facts.append(f"{resource['utilization_pct']:.0f}% busy")
        heat = resource.get("heat")
        if heat and heat.get("temperature_c") is not None:
            facts.append(f"{heat['temperature_c']:g}°C" + (" (hot)" if heat["engaged"] else ""))
        if not resource["enabled"]:
            facts.append("switched off")
        if resource.get("reserved_by") is not None:
            facts.append(f"reserved by job {resource['reserved_by']}")
        if resource.get("refuses"):
            facts.append(f"refuses {resource['refuses']}: {resource['refusal_detail']}")
        lines.append(f"  {name}: " + " · ".join(facts))
    lines.append("upstreams:")
    for name, upstream in document["upstreams"].items():
        refused = ", ".join(f"{k} {v}" for k, v in sorted(upstream["refused"].items())) or "none"
        where = ", ".join(upstream["bound"]) or upstream["listen"]
        lines.append(
            f"  {name} ({upstream['adapter']}): {where} -> {upstream['target']}"
            f" · admitted {upstream['admitted']} · refused {refused}"
            + _reachability_words(upstream.get("reachability"))
        )
        for job in upstream["active_work"]:
            lines.append(
                f"    job {job['job_id']} {job['phase']} {job.get('model') or ''} "
                f"for {job['running_s']:.0f}s"
                + (f" by {job['borrower']}" if "borrower" in job else "")
            )
        last = upstream.get("last_refusal")
        if last:
            lines.append(f"    last refusal: {last['reason']} ({last['detail']})")
        if upstream.get("unseen_gpu_work"):
            lines.append("    unseen_gpu_work: admitted work runs but no process of it uses a GPU")
        if "not guaranteed" in upstream.get("memory_recovery", ""):
            lines.append(f"    memory recovery: {upstream['memory_recovery']}")
    for problem in document.get("state_files", []):
        lines.append(f"state file {problem['path']} {problem['reason']}: {problem['consequence']}")
    lines.extend(_borrower_lines(document.get("borrowers") or {}))
    lines.extend(_operator_lines(document))
    return "\n".join(lines)


def _reachability_words(reach: dict[str, Any] | None) -> str:
    """Whether the upstream answers at all: admission counts alone do not say."""
    if reach is None:
        return ""
    if reach["ok"] is None:
        return " · not contacted yet"
    if reach["ok"]:
        return " · answers"
    since = reach.get("last_ok_age_s")
    answered = "never answered" if since is None else f"last answered {since:.0f}s ago"
    return (
        f" · NOT ANSWERING ({reach['last_error']}, {reach['last_error_age_s']:.0f}s ago; "
        f"{answered})"
    )


def _borrower_lines(borrowers: dict[str, Any]) -> list[str]:
    """Who borrowed since the daemon started, and what they held."""
    if not borrowers:
        return []
    lines = ["borrowers:"]
    for name, use in borrowers.items():
        refused = ", ".join(f"{k} {v}" for k, v in use["refused"].items()) or "none"
        held = ", ".join(f"{r} {s:.0f}s" for r, s in use["held_s"].items()) or "nothing"
        running = f" · {use['active_jobs']} running" if use["active_jobs"] else ""
        lines.append(
            f"  {name}: admitted {use['admitted']} · refused {refused} · held {held}{running}"
        )
    return lines


def _lending_words(lending: dict[str, Any]) -> str:
    """The lending switch in words: on, PAUSED, or PAUSED until when (and for how long)."""
    from vacancyd.durations import describe_duration

    if lending["enabled"]:
        return "on"
    if not lending.get("paused_until"):
        return "PAUSED"
    left = describe_duration(lending.get("resumes_in_s") or 0)
    return f"PAUSED until {local_time(lending['paused_until'])} (resumes in {left})"


def _hours_lines(hours: dict[str, Any] | None) -> list[str]:
    """The lending hours, when there are any: inside or not, and the next change (in the
    owner's zone, which the first line names)."""
    from datetime import datetime

    from vacancyd.durations import describe_duration

    if not hours or hours.get("always", True):
        return []
    windows = "; ".join(
        f"{','.join(w['days'])} {w['from']}-{w['to']}" for w in hours.get("schedule", [])
    )
    inside = hours.get("inside")
    where = "inside a window" if inside else "OUTSIDE them (host-scoped upstreams refuse)"
    change = hours.get("next_change")
    if change:
        what = "closes" if inside else "opens"
        left = describe_duration(hours.get("next_change_in_s") or 0)
        at = datetime.fromisoformat(change).strftime("%a %Y-%m-%d %H:%M")
        where += f"; {what} {at} (in {left})"
    return [f"lending hours ({hours.get('timezone') or 'local time'}): {windows}", f"  {where}"]


def _operator_lines(document: dict[str, Any]) -> list[str]:
    """The debug window while it is open, and any essential task that is stuck."""
    from vacancyd.durations import describe_duration

    lines = []
    debug = document.get("debug_logging") or {}
    if debug.get("active"):
        ends = describe_duration(debug.get("ends_in_s") or 0)
        lines.append(f"debug logging: on, turns itself off in {ends}")
    liveness = document.get("liveness") or {}
    if liveness.get("problems"):
        lines.append("NOT MAKING PROGRESS: " + "; ".join(liveness["problems"]))
    return lines


def _age(age: float | None) -> str:
    return "" if age is None else f" ({age:.1f}s old)"


def local_time(iso: str) -> str:
    """An ISO time from the daemon in this machine's local time, for a person."""
    from datetime import datetime

    return datetime.fromisoformat(iso).astimezone().strftime("%a %Y-%m-%d %H:%M %Z")
