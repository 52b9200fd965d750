// The layerpy dashboard: every node as a coloured cell, live over the event stream.
//
// One listing of the nodes, then the stream from the listing's sequence number on
// (X-Layerpy-Seq), so no change falls between the two. Changes only mark cells dirty; the
// cells are repainted once per animation frame, however many changes arrived, which keeps
// 10 000 nodes and hundreds of changes a second smooth. Everything a node sent is shown
// as text (textContent), never as HTML.
"use strict";

const TOKEN_KEY = "layerpy-token";
const EVENTS_KEPT = 5000; // recent events kept for the node panel
const PANEL_REFRESH = 2000; // ms between refreshes of the open panel's console and explain
const RETRY = 2000; // ms before the stream is opened again after it broke

const LEGENDS = {
  run: ["ready", "busy", "booting", "init", "lost", "error", "unknown"],
  power: ["on", "off", "hang", "error", "unknown"],
  image: ["active", "pulling", "updating", "stale", "error", "none", "unknown"],
};
const LIVE_FIELDS = ["power", "run_state", "busy", "image_state", "location", "console_problem",
  "conflict", "problem", "power_error", "image_error", "owner"];

const state = {
  token: sessionStorage.getItem(TOKEN_KEY),
  nodes: new Map(), // name -> live fields
  cells: new Map(), // name -> element
  dirty: new Set(),
  painting: false,
  regroup: false,
  lastId: null,
  events: [],
  selected: null,
  admin: false,
  stream: null, // AbortController of the open stream
  panelTimer: null,
};
const $ = (id) => document.getElementById(id);
const byName = new Intl.Collator(undefined, { numeric: true }).compare;

// -- talking to the API --------------------------------------------------------------------

class LoggedOut extends Error {}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}), Authorization: `Bearer ${state.token}` };
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    login("that token is not (or no longer) valid");
    throw new LoggedOut();
  }
  return response;
}

async function json(path, options) {
  const response = await api(path, options);
  if (!response.ok) throw new Error(`${path}: ${response.status} ${await response.text()}`);
  return response.json();
}

async function post(path, body) {
  const response = await api(path, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const text = await response.text();
  return { ok: response.ok, text };
}

function login(problem) {
  if (state.stream) state.stream.abort();
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = null;
  $("login-error").textContent = problem || "";
  if (!$("login").open) $("login").showModal();
}

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  state.token = $("token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, state.token);
  $("login").close();
  start();
});

// -- the nodes and their colours ----------------------------------------------------------

function live(node) {
  return {
    name: node.name,
    group: node.group || "(no group)",
    power: node.power,
    run_state: node.run_state,
    busy: node.busy,
    image_state: node.image ? node.image.state : "unknown",
    location: node.location,
    console_problem: node.console_problem,
    conflict: node.conflict,
    problem: node.problem,
    power_error: node.power_error,
    image_error: node.image ? node.image.error : null,
    owner: node.owner, // in a cluster only: the instance that acts on it ("": none yet)
  };
}

function colour(node) {
  const by = $("colour-by").value;
  if (by === "power") return node.power;
  if (by === "image") return node.image_state;
  return node.run_state === "ready" && node.busy === "busy" ? "busy" : node.run_state;
}

function troubled(node) {
  return Boolean(node.console_problem || node.conflict || node.problem || node.power_error ||
    node.image_error);
}

function cellClass(node) {
  const hidden = shown(node) ? "" : " hidden";
  const selected = node.name === state.selected ? " selected" : "";
  return `node s-${colour(node)}${troubled(node) ? " problem" : ""}${selected}${hidden}`;
}

function shown(node) {
  const filter = $("filter").value.trim().toLowerCase();
  if (!filter) return true;
  return node.name.toLowerCase().includes(filter) || colour(node) === filter ||
    node.group.toLowerCase() === filter;
}

function sectionOf(node) {
  if ($("group-by").value === "group") return node.group;
  if ($("group-by").value === "owner") {
    return node.owner ? `instance ${node.owner}` : "(no owner yet)";
  }
  const where = node.location;
  return where && where.switch ? `switch ${where.switch}` : "(no location seen)";
}

function render() {
  const sections = new Map();
  const names = [...state.nodes.keys()].sort(byName);
  const bySwitch = $("group-by").value === "switch";
  if (bySwitch) names.sort((a, b) => byName(port(a), port(b)));
  for (const name of names) {
    const node = state.nodes.get(name);
    const key = sectionOf(node);
    if (!sections.has(key)) sections.set(key, []);
    sections.get(key).push(node);
  }
  const grid = document.createDocumentFragment();
  state.cells.clear();
  for (const key of [...sections.keys()].sort(byName)) {
    const section = document.createElement("section");
    section.className = "group";
    const title = document.createElement("h2");
    title.textContent = key;
    const count = document.createElement("small");
    count.textContent = ` ${sections.get(key).length} nodes`;
    title.append(count);
    const cells = document.createElement("div");
    cells.className = "cells";
    for (const node of sections.get(key)) {
      const cell = document.createElement("div");
      cell.className = cellClass(node);
      cell.dataset.name = node.name;
      cell.title = bySwitch && node.location ? `${node.name} (port ${node.location.port})`
        : node.name;
      if (state.nodes.size <= 200) { // few nodes: names on the cells
        cell.classList.add("wide");
        cell.textContent = node.name;
      }
      state.cells.set(node.name, cell);
      cells.append(cell);
    }
    section.append(title, cells);
    grid.append(section);
  }
  $("grid").replaceChildren(grid);
  summarise();
}

function port(name) {
  const where = state.nodes.get(name).location;
  return where && where.port ? String(where.port) : "";
}

function summarise() {
  const counts = new Map();
  for (const node of state.nodes.values()) {
    const value = colour(node);
    counts.set(value, (counts.get(value) || 0) + 1);
  }
  const parts = [];
  for (const [value, count] of [...counts].sort((a, b) => b[1] - a[1])) {
    const part = document.createElement("span");
    part.textContent = `${count} ${value}`;
    parts.push(part);
  }
  const total = document.createElement("strong");
  total.textContent = `${state.nodes.size} nodes:`;
  $("summary").replaceChildren(total, ...parts);
}

function legend() {
  $("legend").replaceChildren(...LEGENDS[$("colour-by").value].map((value) => {
    const item = document.createElement("span");
    item.style.setProperty("--c", getComputedStyle(document.documentElement)
      .getPropertyValue(`--${cssVar(value)}`));
    item.textContent = value;
    return item;
  }));
}

function cssVar(value) {
  return { ready: "good", on: "good", active: "good", busy: "busy", booting: "going",
    pulling: "going", updating: "going", init: "wait", stale: "wait", hang: "wait",
    lost: "bad", error: "dead", off: "off", none: "off" }[value] || "unknown";
}

function paintSoon(name) {
  state.dirty.add(name);
  if (state.painting) return;
  state.painting = true;
  requestAnimationFrame(() => {
    state.painting = false;
    if (state.regroup) { // a node moved to another switch: its sections again, once a frame
      state.regroup = false;
      render();
    }
    for (const dirty of state.dirty) {
      const cell = state.cells.get(dirty);
      const node = state.nodes.get(dirty);
      if (cell && node) cell.className = cellClass(node) + (cell.classList.contains("wide")
        ? " wide" : "");
    }
    state.dirty.clear();
    summarise();
    document.body.dataset.seq = String(state.lastId ?? "");
  });
}

function repaintAll() {
  for (const name of state.nodes.keys()) state.dirty.add(name);
  paintSoon(state.selected || "");
}

// -- the stream --------------------------------------------------------------------------

async function loadNodes() {
  const response = await api("/api/v1/nodes");
  if (!response.ok) throw new Error(`/api/v1/nodes: ${response.status}`);
  const seq = response.headers.get("X-Layerpy-Seq");
  const listed = await response.json();
  state.nodes = new Map(listed.map((node) => [node.name, live(node)]));
  $("group-by-owner").hidden = !listed.some((node) => node.owner !== undefined);
  state.lastId = seq === null ? null : Number(seq);
  render();
  if (!performance.getEntriesByName("layerpy-grid").length) {
    // the first grid painted: what bench/dashboard.py times
    requestAnimationFrame(() => setTimeout(() => performance.mark("layerpy-grid"), 0));
  }
  document.body.dataset.nodes = String(state.nodes.size);
  document.body.dataset.seq = String(state.lastId ?? "");
}

async function follow() {
  for (;;) {
    const controller = new AbortController();
    state.stream = controller;
    try {
      const headers = state.lastId === null ? {} : { "Last-Event-ID": String(state.lastId) };
      const response = await api("/api/v1/events/stream", { headers, signal: controller.signal });
      if (!response.ok) throw new Error(`stream: ${response.status}`);
      connection(true);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          await heard(parse(buffer.slice(0, end)));
          buffer = buffer.slice(end + 2);
        }
      }
    } catch (error) {
      if (error instanceof LoggedOut || !state.token) return;
    }
    connection(false);
    await new Promise((resolve) => setTimeout(resolve, RETRY));
  }
}

function parse(block) {
  const event = { id: null, kind: "message", data: "" };
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "id") event.id = Number(value);
    else if (field === "event") event.kind = value;
    else if (field === "data") event.data += value;
  }
  return event;
}

async function heard(event) {
  if (event.kind === "gap") { // fell behind or resumed too late: read everything again
    await loadNodes();
    return;
  }
  if (event.id === null || !event.data) return;
  state.lastId = event.id;
  const change = JSON.parse(event.data);
  const node = state.nodes.get(change.node);
  if (change.kind === "event" && change.fields.event === "reloaded") {
    await loadNodes(); // nodes came or went: the listing again
    return;
  }
  if (change.kind === "observed" && node) {
    for (const [key, value] of Object.entries(change.fields)) {
      if (LIVE_FIELDS.includes(key)) node[key] = value;
    }
    const by = $("group-by").value;
    const moved = by === "switch" ? "location" : by === "owner" ? "owner" : null;
    if (moved && moved in change.fields) {
      state.regroup = true;
      paintSoon(change.node);
    }
  }
  if (change.kind !== "observed" || change.message) {
    state.events.push(change);
    if (state.events.length > EVENTS_KEPT) state.events.splice(0, state.events.length / 2);
  }
  paintSoon(change.node);
  if (change.node === state.selected) showEvents();
}

function connection(up) {
  $("connection").textContent = up ? "live" : "reconnecting…";
  $("connection").className = `connection ${up ? "live" : "down"}`;
}

// -- one node's panel ---------------------------------------------------------------------

function select(name) {
  const before = state.cells.get(state.selected);
  if (before) before.classList.remove("selected");
  state.selected = name;
  const cell = state.cells.get(name);
  if (cell) cell.classList.add("selected");
  $("panel").hidden = false;
  $("panel-name").textContent = name;
  $("action-result").textContent = "";
  $("actions").hidden = !state.admin;
  clearInterval(state.panelTimer);
  refreshPanel();
  state.panelTimer = setInterval(refreshPanel, PANEL_REFRESH);
}

function closePanel() {
  clearInterval(state.panelTimer);
  $("panel").hidden = true;
  const cell = state.cells.get(state.selected);
  if (cell) cell.classList.remove("selected");
  state.selected = null;
}

async function refreshPanel() {
  const name = state.selected;
  if (!name) return;
  const path = `/api/v1/nodes/${encodeURIComponent(name)}`;
  try {
    const [node, explained] = await Promise.all([json(path), json(`${path}/explain`)]);
    if (name !== state.selected) return;
    showFacts(node);
    showTimeline(node.timeline || {});
    $("why").textContent = why(explained);
    $("explain").textContent = JSON.stringify(explained, null, 2);
    showEvents();
    const console = await api(`${path}/console?bytes=16384`);
    $("console").textContent = console.ok ? await console.text()
      : `(no console: ${(await console.text()).trim()})`;
    $("console").scrollTop = $("console").scrollHeight;
  } catch (error) {
    if (!(error instanceof LoggedOut)) $("explain").textContent = String(error);
  }
}

function why(explained) {
  // The engine's answer in a sentence: where the node stands and what comes next.
  const lines = [];
  if (explained.console) lines.push(`console: ${explained.console}`);
  if (explained.gave_up) lines.push(explained.gave_up);
  if (explained.blocked) lines.push(`blocked: ${explained.blocked}`);
  if (explained.held) lines.push(`held: ${explained.held}`); // the fence: not this instance's
  const current = explained.current;
  if (current) {
    lines.push(`now: ${current.mutation} (${current.status}, ${current.elapsed} s)`);
  }
  if (explained.plan && explained.plan.length) lines.push(`next: ${explained.plan.join(" → ")}`);
  if (explained.retry_in) lines.push(`retrying in ${explained.retry_in} s`);
  const failed = explained.failures || [];
  if (failed.length) {
    const last = failed[failed.length - 1];
    lines.push(`last failure: ${last.mutation} ${last.reason} (${Math.round(last.ago)} s ago)`);
  }
  if (explained.converged) lines.push("converged: as the node file says");
  return lines.join("\n");
}

function showFacts(node) {
  const facts = [
    ["group", node.group], ["mac", node.mac], ["ip", node.ip], ["hostname", node.hostname],
    ["power", node.power], ["run state", node.run_state], ["busy", node.busy],
    ["image", `${node.image.name || "-"} (${node.image.state})`],
    ["digest", node.image.digest], ["files", node.files && node.files.revision],
    ["boots", node.boots], ["firmware", node.boot && node.boot.firmware],
    ["location", node.location && `${node.location.switch} port ${node.location.port} ` +
      `(${node.location.source})`],
    ["last report", node.last_report && `${Math.round(Date.now() / 1000 - node.last_report)} s ago`],
    ["agent", node.agent && node.agent.version],
    ["secure boot", {true: "on", false: "off"}[node.secure_boot]],
    ["console", node.console_problem], ["conflict", node.conflict], ["problem", node.problem],
    ["power error", node.power_error], ["image error", node.image.error],
    ["owner", node.owner === "" ? "none yet" : node.owner],
  ];
  $("facts").replaceChildren(...facts.filter(([, value]) => value !== null && value !== undefined
    && value !== "").flatMap(([term, value]) => {
    const dt = document.createElement("dt");
    dt.textContent = term;
    const dd = document.createElement("dd");
    dd.textContent = String(value);
    return [dt, dd];
  }));
}

function showTimeline(timeline) {
  $("timeline").replaceChildren(...Object.entries(timeline).map(([phase, seconds]) => {
    const item = document.createElement("li");
    item.textContent = `${phase} +${Number(seconds).toFixed(1)} s`;
    return item;
  }));
}

function showEvents() {
  const name = state.selected;
  const mine = state.events.filter((change) => change.node === name).slice(-30).reverse();
  $("events").replaceChildren(...mine.map((change) => {
    const item = document.createElement("li");
    const when = new Date(change.time * 1000).toLocaleTimeString();
    const fields = change.kind === "observed" ? Object.entries(change.fields)
      .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ") : "";
    item.textContent = `${when} ${change.kind} ${change.message || fields}`;
    return item;
  }));
}

async function powerAction(action) {
  const name = state.selected;
  $("action-result").textContent = `power ${action} ${name}…`;
  const { ok, text } = await post("/api/v1/power", { nodes: name, action });
  $("action-result").textContent = ok ? `power ${action} ${name}: done` : text;
  refreshPanel();
}

async function imageAction() {
  const name = state.selected;
  const image = $("image-choice").value;
  const { ok, text } = await post("/api/v1/image", { nodes: name, image });
  $("action-result").textContent = ok ? `image ${image} on ${name}: asked` : text;
  refreshPanel();
}

// -- starting ------------------------------------------------------------------------------

async function start() {
  if (!state.token) {
    login();
    return;
  }
  try {
    const who = await json("/api/v1/whoami");
    state.admin = who.scope === "admin";
    $("who").textContent = `${who.name} (${who.scope})`;
    const images = await json("/api/v1/images");
    $("image-choice").hidden = $("image-set").hidden = !images.length;
    const names = [...new Set(images.map((image) => image.name))]; // one entry per platform
    $("image-choice").replaceChildren(...names.map((name) => {
      const option = document.createElement("option");
      option.textContent = name;
      return option;
    }));
    await loadNodes();
  } catch (error) {
    if (!(error instanceof LoggedOut)) $("connection").textContent = String(error);
    return;
  }
  follow();
}

$("grid").addEventListener("click", (event) => {
  const cell = event.target.closest(".node");
  if (cell) select(cell.dataset.name);
});
$("panel-close").addEventListener("click", closePanel);
$("colour-by").addEventListener("change", () => { legend(); repaintAll(); });
$("group-by").addEventListener("change", render);
$("filter").addEventListener("input", repaintAll);
for (const button of document.querySelectorAll("[data-power]")) {
  button.addEventListener("click", () => powerAction(button.dataset.power));
}
$("image-set").addEventListener("click", imageAction);
legend();
start();
