"use strict";
// The owner console. It reads /status (read scope) and /vacancy/<upstream> (what a
// request would get now), and changes switches through /admin (admin scope).
//
// From this machine it usually needs no token (auth.trust_loopback). From another one
// the daemon answers 401: the console then asks for a token once, keeps it in this tab's
// sessionStorage (gone when the tab closes) and sends it as a bearer token; a token the
// daemon rejects is asked for again. Everything the daemon says is shown as text
// (textContent), never parsed as HTML, and the page runs under a CSP without inline code.
//
// Features added to /status later (snooze, lending hours, reachability) are shown when
// the document has them and left out when it does not, so the page works against any
// daemon that serves it.

const TOKEN_KEY = "vacancyd.token";
const REFRESH_MS = 3000;
const $ = (id) => document.getElementById(id);

class NeedToken extends Error {}

let timer = null;

// -- talking to the daemon --------------------------------------------------------------

function savedToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

async function call(method, path, body) {
  const headers = {Accept: "application/json"};
  const token = savedToken();
  if (token) headers.Authorization = "Bearer " + token;
  const init = {method, headers, cache: "no-store"};
  // Anything but a read goes as JSON ({} when there is nothing to say): the daemon
  // refuses other bodies on requests that change something, so that another site's page
  // cannot forge one with a plain form.
  if (method !== "GET" && method !== "HEAD") {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body === undefined ? {} : body);
  }
  const response = await fetch(path, init);
  let payload = null;
  try {
    payload = await response.json();
  } catch (_) {
    payload = null;
  }
  if (response.status === 401) {
    askToken(token ? "The daemon did not accept that token; enter another."
                   : "This daemon needs a token to show its status.");
    throw new NeedToken();
  }
  return {status: response.status, ok: response.ok, payload};
}

function explain(answer) {
  const error = answer.payload && answer.payload.error;
  if (error && error.message) return error.message;
  return "the daemon answered " + answer.status;
}

// -- the token -----------------------------------------------------------------------------

function askToken(why) {
  clearTimeout(timer);
  sessionStorage.removeItem(TOKEN_KEY);
  $("token-why").textContent = why;
  $("token-form").hidden = false;
  $("token-input").value = "";
  $("token-input").focus();
}

$("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const token = $("token-input").value.trim();
  if (!token) return;
  sessionStorage.setItem(TOKEN_KEY, token);
  $("token-form").hidden = true;
  refresh();
});

// -- actions -------------------------------------------------------------------------------

async function act(what, path, body) {
  try {
    const answer = await call("POST", path, body);
    if (answer.ok) {
      showError("");
    } else {
      showError(what + " failed: " + explain(answer), answer.status === 403);
    }
  } catch (error) {
    if (error instanceof NeedToken) return;
    showError(what + " failed: " + error.message);
  }
  refresh();
}

// The owner's pause gives the machine back at once: running borrowed work is reclaimed.
$("pause").addEventListener("click", () =>
  act("Pausing", "/admin/lending", {enabled: false, now: true}));
$("resume").addEventListener("click", () =>
  act("Resuming", "/admin/lending", {enabled: true}));
for (const button of document.querySelectorAll("#snooze button[data-for-s]")) {
  button.addEventListener("click", () =>
    act("Pausing", "/admin/lending",
        {enabled: false, for_s: Number(button.dataset.forS), now: true}));
}

// -- refresh -------------------------------------------------------------------------------

async function refresh() {
  clearTimeout(timer);
  try {
    const answer = await call("GET", "/status");
    if (!answer.ok) {
      showError("Cannot read the status: " + explain(answer), answer.status === 403);
      return;
    }
    const status = answer.payload;
    const vacancy = {};
    await Promise.all(Object.keys(status.upstreams).map(async (name) => {
      const probe = await call("GET", "/vacancy/" + encodeURIComponent(name));
      vacancy[name] = probe.payload;
    }));
    render(status, vacancy);
    $("main").hidden = false;
    if ($("error").dataset.sticky !== "1") showError("");
  } catch (error) {
    if (error instanceof NeedToken) return; // the token form calls refresh again
    showError("Cannot reach the daemon: " + error.message);
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

function showError(text, offerToken) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
  box.dataset.sticky = text && offerToken ? "1" : "";
  if (text && offerToken) {
    const again = el("button", {type: "button", class: "small"}, "Use another token");
    again.addEventListener("click", () => {
      box.dataset.sticky = "";
      askToken("Enter a token with the admin scope to change settings.");
    });
    box.append(" ", again);
  }
}

// -- rendering -----------------------------------------------------------------------------

function render(s, vacancy) {
  renderMeta(s);
  renderLending(s);
  renderRefusals(s, vacancy);
  renderResources(s);
  renderUpstreams(s, vacancy);
  renderBorrowers(s);
  renderProblems(s);
}

function renderMeta(s) {
  const meta = $("meta");
  meta.textContent = "vacancyd " + s.version + " · up " + duration(s.uptime_s) + " · " +
    (s.ready ? "ready" : "NOT READY") + " · updated " + new Date().toLocaleTimeString();
  if (savedToken()) {
    const forget = el("button", {type: "button", class: "small", id: "forget-token"},
                      "Forget token");
    forget.addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      refresh();
    });
    meta.append(" · using a token ", forget);
  }
}

function renderLending(s) {
  const lending = s.lending;
  const snoozes = "paused_until" in lending || "resumes_in_s" in lending;
  const hours = lendingHours(s);
  const box = $("lending");
  let detail = "";
  if (!lending.enabled && lending.resumes_in_s != null) {
    box.textContent = "Lending is paused for " + duration(lending.resumes_in_s, true) + " more";
    box.className = "lending off";
    const at = new Date(Date.now() + lending.resumes_in_s * 1000);
    detail = "It resumes by itself at " + at.toLocaleString([], {weekday: "short",
      hour: "2-digit", minute: "2-digit"}) + ", or when you resume it.";
  } else if (!lending.enabled) {
    box.textContent = "Lending is paused";
    box.className = "lending off";
    detail = "Until you resume it. Borrowed requests are refused with lending_disabled.";
  } else if (hours && hours.inside === false) {
    box.textContent = "Lending is on, but outside the lending hours";
    box.className = "lending limited";
    detail = sentence(hours.refusal_detail || "");
  } else {
    box.textContent = "Lending is on";
    box.className = "lending on";
  }
  $("lending-detail").textContent = detail;
  $("snooze").hidden = !snoozes;
  $("pause").textContent = snoozes ? "Pause until I resume" : "Pause lending";
  $("pause").disabled = !lending.enabled && lending.resumes_in_s == null;
  $("resume").disabled = lending.enabled;
  const line = $("hours");
  line.hidden = !hours;
  if (hours) line.textContent = describeHours(hours);
}

// /status `lending_hours` (null from a daemon without lending hours).
function lendingHours(s) {
  const hours = s.lending_hours;
  return hours && typeof hours === "object" ? hours : null;
}

function describeHours(hours) {
  if (hours.always || !(hours.schedule || []).length) {
    return "Lending hours: any time (no lending_hours in [owner]).";
  }
  const windows = hours.schedule.map((w) =>
    (w.days && w.days.length < 7 ? w.days.join(", ") + " " : "every day ") + w.from + "–" + w.to);
  let text = "Lending hours: " + windows.join("; ");
  if (hours.timezone) text += " (" + hours.timezone + ")";
  if (hours.inside != null) {
    text += ". Now " + (hours.inside ? "inside" : "outside");
    if (hours.next_change_in_s != null) {
      text += "; " + (hours.inside ? "closes" : "opens") + " in " +
        duration(hours.next_change_in_s, true);
    }
    text += ".";
  }
  return text;
}

function renderRefusals(s, vacancy) {
  const list = $("refusals");
  list.textContent = "";
  for (const name of Object.keys(s.upstreams)) {
    const answer = vacancy[name];
    const item = el("li", {}, el("strong", {}, name), ": ");
    if (answer && answer.vacancy) {
      item.append(badge("ok", "takes work"));
    } else if (answer && answer.error) {
      item.append(badge("bad", answer.error.code), " " + answer.error.message);
    } else {
      item.append("unknown");
    }
    list.append(item);
  }
  const p = s.presence;
  // Features added to /status later (decided_by, power) are shown when present.
  $("presence").textContent = "Owner presence: " + p.backend + " · " +
    (p.session || "no reading yet") + " · " + p.quality +
    (p.decided_by ? " · decided by " + p.decided_by : "") +
    (s.power && s.power.read && s.power.on_battery ? " · on battery" : "") +
    (p.refuses ? " · refuses " + p.refuses + ": " + p.refusal_detail : "") +
    (s.owner_veto && s.owner_veto.engaged ? " · owner veto: " + s.owner_veto.reason : "");
}

function renderResources(s) {
  const body = $("resources");
  body.textContent = "";
  for (const [name, r] of Object.entries(s.resources)) {
    const toggle = el("button", {type: "button", class: "small"},
                      r.enabled ? "Switch off" : "Switch on");
    toggle.addEventListener("click", () => act(
      (r.enabled ? "Switching off " : "Switching on ") + name,
      "/admin/resources/" + encodeURIComponent(name), {enabled: !r.enabled}));
    const free = r.free_bytes != null ? mib(r.free_bytes / 1048576)
      : (r.utilization_pct != null ? Math.round(r.utilization_pct) + "% busy" : "—");
    const reading = [r.quality + (r.age_s != null ? " · " + r.age_s.toFixed(1) + " s old" : "")];
    if (r.detail) reading.push(el("span", {class: "why"}, r.detail));
    body.append(row([
      [el("strong", {}, name), el("span", {class: "why"}, r.kind)],
      [badge(r.enabled ? "ok" : "bad", r.enabled ? "on" : "off"), " ", toggle],
      reading,
      [free],
      [r.spare_mib != null ? mib(r.spare_mib) : "—"],
      refusesCell(r),
    ], "resource-" + name));
  }
}

function refusesCell(r) {
  if (r.refuses) return [badge("bad", r.refuses), el("span", {class: "why"}, r.refusal_detail)];
  if (r.reserved_by != null) {
    return [badge("warn", "in use"), el("span", {class: "why"}, "by job " + r.reserved_by)];
  }
  return [badge("ok", "nothing")];
}

function renderUpstreams(s, vacancy) {
  const body = $("upstreams");
  const work = $("work");
  body.textContent = "";
  work.textContent = "";
  for (const [name, u] of Object.entries(s.upstreams)) {
    const answer = vacancy[name];
    const now = answer && answer.vacancy ? [badge("ok", "takes work")]
      : (answer && answer.error ? [badge("bad", answer.error.code)] : ["—"]);
    const held = u.active_work.filter((job) => job.phase === "held").length;
    const running = u.active_work.length - held;
    body.append(row([
      [el("strong", {}, name), el("span", {class: "why"}, u.adapter + " → " + u.target)],
      reachability(u.reachability),
      now,
      [String(u.admitted)],
      [counts(u.refused) || "0"],
      [running + (held ? " · " + held + " held" : "")],
    ], "upstream-" + name));
    const section = workSection(name, u);
    if (section) work.append(section);
  }
}

function reachability(r) {
  if (!r) return ["—"];
  if (r.ok === null) return [badge("warn", "not contacted yet")];
  if (r.ok) {
    return [badge("ok", "yes"),
            el("span", {class: "why"}, "answered " + ago(r.last_ok_age_s))];
  }
  return [badge("bad", "no"), el("span", {class: "why"},
    r.last_error + " (" + ago(r.last_error_age_s) + "; " +
    (r.last_ok_age_s == null ? "never answered" : "last answered " + ago(r.last_ok_age_s)) +
    ")")];
}

function workSection(name, u) {
  const items = [];
  for (const job of u.active_work) {
    const words = ["job " + job.job_id];
    if (job.borrower) words.push(job.borrower);
    words.push(job.phase);
    if (job.model) words.push(job.model);
    words.push("for " + duration(job.running_s));
    const item = el("li", {}, words.join(" · "));
    if (job.phase === "held") {
      const since = job.held_since ? new Date(job.held_since).toLocaleString() : "?";
      item.append(el("span", {class: "why"}, "held since " + since + ": " +
                                             (job.hold_reason || "")));
      const release = el("button", {type: "button", class: "small"}, "Release hold");
      release.addEventListener("click", () => act("Releasing job " + job.job_id,
        "/admin/holds/" + job.job_id + "/release", undefined));
      item.append(release);
    }
    items.push(item);
  }
  const reclaim = u.reclaim || {};
  if (reclaim.current) items.push(el("li", {}, "Reclaim in progress: " + describeReclaim(reclaim.current)));
  if (reclaim.last) items.push(el("li", {}, "Last reclaim: " + describeReclaim(reclaim.last)));
  if (!items.length) return null;
  return el("div", {class: "work", id: "work-" + name}, el("h3", {}, name),
            el("ul", {}, ...items));
}

function describeReclaim(r) {
  const words = [r.trigger, r.policy, r.phase];
  if (r.edges_age_s && r.edges_age_s.length) words.push(ago(r.edges_age_s[0]));
  if (r.deadline_in_s != null && r.deadline_in_s > 0) {
    words.push("deadline in " + duration(r.deadline_in_s));
  }
  if (r.cancelled_jobs && r.cancelled_jobs.length) words.push("cut jobs " + r.cancelled_jobs.join(", "));
  if (r.unload) words.push("unload: " + r.unload);
  return words.join(" · ");
}

function renderBorrowers(s) {
  const body = $("borrowers");
  body.textContent = "";
  const borrowers = s.borrowers || {};
  if (!Object.keys(borrowers).length) {
    const none = el("td", {colspan: "6"}, "Nobody has borrowed since the daemon started.");
    body.append(el("tr", {id: "borrowers-none"}, none));
    return;
  }
  for (const [name, b] of Object.entries(borrowers)) {
    const held = Object.entries(b.held_s).map(([r, sec]) => r + " " + duration(sec));
    body.append(row([
      [el("strong", {}, name)],
      [String(b.admitted)],
      [counts(b.refused) || "0"],
      [held.join(", ") || "—"],
      [String(b.active_jobs)],
      [b.last_decision_age_s == null ? "—" : ago(b.last_decision_age_s)],
    ], "borrower-" + name));
  }
}

function renderProblems(s) {
  const list = $("problems");
  list.textContent = "";
  for (const f of s.state_files || []) {
    list.append(el("li", {}, f.path + " " + f.reason + ": " + f.consequence));
  }
  for (const problem of (s.liveness && s.liveness.problems) || []) {
    list.append(el("li", {}, "Not making progress: " + problem));
  }
  for (const [name, note] of Object.entries(s.collectors || {})) {
    list.append(el("li", {}, name + ": " + note));
  }
  $("problems-card").hidden = !list.childElementCount;
}

// -- small helpers -------------------------------------------------------------------------

function el(tag, attributes, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  node.append(...children);
  return node;
}

function row(cells, id) {
  const tr = el("tr", {id});
  for (const content of cells) tr.append(el("td", {}, ...content));
  return tr;
}

function badge(kind, text) {
  return el("span", {class: "badge " + kind}, text);
}

function counts(table) {
  return Object.entries(table || {}).map(([k, v]) => k + " " + v).join(", ");
}

function mib(value) {
  const sign = value < 0 ? "−" : "";
  const size = Math.abs(value);
  if (size >= 1024) return sign + (size / 1024).toFixed(1) + " GiB";
  return sign + Math.round(size) + " MiB";
}

function duration(seconds, roundUp) {
  if (seconds == null) return "?";
  const s = roundUp ? Math.ceil(seconds) : Math.round(seconds);
  if (s < 60) return s + " s";
  const minutes = roundUp ? Math.ceil(s / 60) : Math.round(s / 60);
  if (minutes < 60) return minutes + " min";
  const h = Math.floor(minutes / 60);
  const m = minutes % 60;
  return h + " h" + (m ? " " + m + " min" : "");
}

function sentence(text) {
  return text ? text[0].toUpperCase() + text.slice(1) + (text.endsWith(".") ? "" : ".") : "";
}

function ago(seconds) {
  return seconds == null ? "never" : duration(seconds) + " ago";
}

refresh();
