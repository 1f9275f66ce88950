// tokenmill web inspector.
//
// A chat whose answers stream in token by token, and beside it the engine's work
// drawn from the trace events of POST /v1/inspect (see tokenmill/server/inspect_routes.py):
// a "start" event (model shape, prompt tokens), one "step" event per engine step
// (prefill, then one per decoded token), then "done". Events go through a small
// player so that, in slow motion, each step walks the pipeline diagram stage by stage.
// Plain chat (tracing off) uses the OpenAI-style /v1/chat/completions stream. A traced
// step runs the slow unfused path, so after each traced answer the same request is sent
// once more untraced to show the engine's own decode speed beside the traced one.

// ------------------------------------------------------------------ helpers

const $ = (id) => document.getElementById(id);

function el(tag, className = "", text = "") {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const clamp01 = (x) => Math.max(0, Math.min(1, x));
const visible = (text) => text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
const quoted = (text) => `'${visible(text)}'`;

function pct(p) {
  if (p >= 0.9995) return "100%";
  if (p >= 0.1) return `${(p * 100).toFixed(1)}%`;
  if (p >= 0.001) return `${(p * 100).toFixed(2)}%`;
  return p > 0 ? "<0.1%" : "0%";
}

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

/** "1 token", "2 tokens", "49,152 tokens". */
const plural = (n, word, many = `${word}s`) => `${fmtInt(n)} ${n === 1 ? word : many}`;
/** A float32 setting as it was typed: 0.8999999761581421 -> "0.9". */
const num = (x) => String(Number(x.toPrecision(6)));

const fmtMs = (ms) => (ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${ms.toFixed(ms < 10 ? 1 : 0)} ms`);
const fmtInt = (n) => n.toLocaleString("en-US");

function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

// The "inferno" colour ramp on a square-root scale: small attention weights stay
// visible next to the large weight many heads park on the first token.
const INFERNO = [
  [0, 0, 4], [40, 11, 84], [101, 21, 110], [159, 42, 99],
  [212, 72, 66], [245, 125, 21], [250, 193, 39], [252, 255, 164],
];

function heatRGB(weight) {
  const x = Math.sqrt(clamp01(weight)) * (INFERNO.length - 1);
  const i = Math.min(INFERNO.length - 2, Math.floor(x));
  const f = x - i;
  const [a, b] = [INFERNO[i], INFERNO[i + 1]];
  return [0, 1, 2].map((k) => Math.round(a[k] + (b[k] - a[k]) * f));
}

const heat = (weight) => `rgb(${heatRGB(weight).join(",")})`;
// Colours by the square root of the weight, in 256 steps (what heat() maps weight to).
const HEAT_LUT = Array.from({ length: 256 }, (_, i) => heatRGB((i / 255) ** 2));

/** Size a canvas for the screen's pixel ratio; returns its context and CSS size. */
function fitCanvas(canvas) {
  const { width, height } = canvas.getBoundingClientRect();
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.max(1, Math.round(width * dpr));
  canvas.height = Math.max(1, Math.round(height * dpr));
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  return { ctx, width, height };
}

// ------------------------------------------------------------------ Server-Sent Events over fetch

/** Yield the JSON payload of every `data:` event of a streaming response, until [DONE]. */
async function* readEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// ------------------------------------------------------------------ state

const history = []; // the conversation sent as `messages`
let conversation = new AbortController(); // "New chat" aborts the answer in flight

/** Everything one traced answer produced. */
function newRun(bubble) {
  return {
    header: null, // the "start" event: model shape, prompt, trace settings
    steps: [], // trace steps in arrival order
    tokens: [], // by position: {id, text, piece, generated, sampleStep, sampleIndex, guessed, inputStep, isStop}
    summary: null,
    selected: null, // position the user clicked; null follows the newest token
    bubble, // the assistant bubble it writes
    request: null, // the body it was asked with (settings, messages)
  };
}

let servedName = null; // the model's name from GET /v1/models (before any answer)
let speculation = null; // the chosen model's speculative method, from GET /metrics; null: none
let untraced = new AbortController(); // the untraced re-run timing the last traced answer
let live = newRun(null); // the answer being streamed: the diagram follows it
let run = live; // the answer the cards show (clicking an older answer's token switches)
const runs = new WeakMap(); // assistant bubble -> its run
let attentionHead = 0;

/** The position the cards describe: the clicked token, or else the newest one. */
const focusPos = () => run.selected ?? run.tokens.length - 1;

/** The sample record that chose a generated token: a verification step emits several. */
const sampleOf = (token) => {
  const step = run.steps[token.sampleStep];
  return step.samples?.[token.sampleIndex] ?? step.sample;
};

/** The step whose forward pass chose the token at `pos` (generated) or read it (prompt). */
function stepFor(pos) {
  const token = run.tokens[pos];
  if (!token) return run.steps.at(-1);
  return run.steps[token.sampleStep ?? token.inputStep] ?? run.steps.at(-1);
}

// ------------------------------------------------------------------ the event player

const player = { queue: [], busy: null };

// Each event is queued with the run it belongs to: after "New chat" replaces `live`, the
// old answer's leftover events are dropped instead of drawn into the cleared inspector.
function enqueue(event) {
  player.queue.push([live, event]);
  player.busy ??= drain();
}

async function drain() {
  while (player.queue.length) {
    const [owner, event] = player.queue.shift();
    if (owner === live) await handle(event);
  }
  player.busy = null;
}

async function playerIdle() {
  while (player.busy) await player.busy;
}

async function handle(event) {
  if (event.type === "start") onStart(event);
  else if (event.type === "step") await onStep(event.step, event.summary);
  else if (event.type === "done") onDone(event);
}

function onStart(header) {
  live.header = header;
  const m = header.model;
  $("model-name").textContent =
    `${servedName ?? m.name} · ${m.arch} · ${plural(m.num_layers, "layer")} · d=${m.hidden_size} · ` +
    `${plural(m.num_heads, "head")} (${m.num_kv_heads} K/V) · vocab ${fmtInt(m.vocab_size)} · ${m.dtype}`;
  $("model-name").title = `weights: ${m.name}`;
  $("layer-count").textContent =
    `× ${plural(m.num_layers, "transformer layer")} — each layer's output is the next one's input`;
  fillLayerSelect(m.num_layers, header.trace.layers[0]);
  attentionHead = Math.min(attentionHead, m.num_heads - 1);
  const p = header.prompt;
  live.tokens = p.ids.map((id, i) => ({ id, text: p.texts[i], piece: p.pieces[i], generated: false }));
}

async function onStep(step, summary) {
  live.steps.push(step);
  live.summary = summary;
  const index = live.steps.length - 1;
  step.positions?.forEach((pos) => {
    if (live.tokens[pos]) live.tokens[pos].inputStep = index;
  });
  showPhase(step);
  await walkPipeline(step, () => step.sample && addGenerated(step, index));
  if (live.steps.at(-1) !== step) return; // "New chat" came during the walk
  renderStats();
  // Live, steps can arrive faster than they draw: then redraw only once caught up.
  const behind = !Number($("slowmo").value) && player.queue.some(([, e]) => e.type === "step");
  if (run === live && !behind) renderAll();
}

function onDone(event) {
  learnCacheRates();
  const n = live.tokens.filter((t) => t.generated).length;
  $("phase").className = "phase done";
  $("phase").textContent = "done";
  $("phase-detail").textContent =
    `${plural(n, "token")} generated · finish reason: ${event.finish_reason} · click any token to look back`;
  $("pipeline").classList.remove("prefill", "decode", "verify");
  live.summary = event.summary;
  renderStats();
  if (run === live) renderTiming();
  const s = event.summary;
  if (event.finish_reason === "length") live.bubble.append(cutMark(n, live.request.max_tokens));
  const meta = el("span", "meta");
  meta.textContent =
    `${plural(n, "token")} · first token after ${fmtMs(s.time_to_first_token_ms)}` +
    (s.decode_tokens_per_s ? ` · ${s.decode_tokens_per_s.toFixed(1)} tok/s traced` : "");
  live.bubble.append(meta);
  timeUntraced(live, meta);
}

/** The mark of an answer that ran out of room (finish_reason "length"): its max_tokens, or
 *  the model's context. Without it such an answer just stopped mid-sentence. */
function cutMark(generated, maxTokens) {
  const atMax = generated >= maxTokens;
  const mark = el("span", "cut-mark", atMax ? `cut at max_tokens = ${maxTokens}` : "cut: the context is full");
  mark.title = "finish_reason: length: the answer did not end, it ran out of tokens" +
    (atMax ? "; raise max tokens in the settings for a longer one" : "");
  return mark;
}

/** Append the step's token(s) to the answer: one, or a verification's accepted guesses
 *  and the target's own token after them (row j's token sits at position start + 1 + j). */
function addGenerated(step, index) {
  const samples = step.samples ?? [step.sample];
  const first = step.speculation ? step.start + 1 : step.start + step.num_tokens;
  samples.forEach((s, j) => {
    const pos = first + j;
    const guessed = Boolean(s.guess_accepted);
    live.tokens[pos] = {
      id: s.token, text: s.token_text, piece: s.piece, generated: true, sampleStep: index,
      sampleIndex: j, guessed, isStop: s.is_stop,
    };
    // an accepted guess already ran as an input row of this very step
    if (guessed) live.tokens[pos].inputStep = index;
    const span = el("span", "tok fresh", s.is_stop ? "" : s.text);
    if (s.is_stop) {
      span.classList.add("stop");
      span.append(" ", el("span", "stop-mark"), s.token_text);
    }
    if (guessed) span.classList.add("guessed");
    span.dataset.pos = pos;
    span.title = `${quoted(s.token_text)} · id ${s.token} · p = ${pct(s.prob)}` +
      (guessed ? " · a speculative guess the model accepted" : "") + " — click for alternatives";
    live.bubble.append(span);
    setTimeout(() => span.classList.remove("fresh"), 700);
  });
  $("messages").scrollTop = $("messages").scrollHeight;
}

// ------------------------------------------------------------------ the pipeline diagram

const PREFILL_STAGES = [
  "tokenize", "embed", "positions", "qkv", "kvwrite", "attention", "mlp",
  "unembed", "softmax", "topp", "sample", "detok", "append",
];
const DECODE_STAGES = PREFILL_STAGES.slice(1);
const SAMPLING_STAGES = new Set(["unembed", "softmax", "topp", "sample", "detok", "append"]);

function stagesOf(step) {
  const stages = step.phase === "prefill" ? PREFILL_STAGES : DECODE_STAGES;
  return step.sample ? stages : stages.filter((s) => !SAMPLING_STAGES.has(s));
}

function showPhase(step) {
  const m = live.header.model;
  const phase = $("phase");
  phase.className = `phase ${step.phase}`;
  phase.textContent = step.phase;
  $("pipeline").classList.remove("prefill", "decode", "verify");
  $("pipeline").classList.add(step.phase);
  const context = step.start + step.num_tokens;
  const sp = step.speculation;
  $("phase-detail").textContent = step.phase === "prefill"
    ? `${plural(step.num_tokens, "prompt token")} go through all ${plural(m.num_layers, "layer")} ` +
      `at once, as one [${step.num_tokens}, ${m.hidden_size}] matrix`
    : sp
    ? `step ${step.index}: ${quoted(live.tokens[step.start]?.text ?? "")} and ` +
      `${plural(sp.proposed.length, "guess", "guesses")} (${sp.method}) in as ${step.num_tokens} rows, ` +
      `one pass over the weights · ${sp.accepted} accepted → ${plural(sp.emitted, "token")} out`
    : `step ${step.index}: one token in (${quoted(live.tokens[step.start]?.text ?? "")}), ` +
      `attending over ${plural(context, "cached key")}, one token out`;
}

/** The small second line of each stage box: what that stage made in this step. */
function shapesOf(step) {
  const m = live.header.model;
  const s = step.sample;
  const layer0 = step.layers?.[0];
  const pos = step.positions ?? [];
  return {
    tokenize: step.phase === "prefill" ? plural(step.num_tokens, "token") : "—",
    embed: step.embedding ? `[${step.embedding.shape.join(", ")}]` : "",
    positions: pos.length > 1 ? `pos ${pos[0]}…${pos.at(-1)}` : pos.length ? `pos ${pos[0]}` : "",
    qkv: layer0 ? `Q [${layer0.q.join(",")}]` : "",
    kvwrite: `+${step.kv.written} → ${step.kv.tokens} tok`,
    attention: layer0 ? `${layer0.q[0]}×${layer0.k[0]} · ${m.num_heads} heads` : "",
    mlp: `${m.hidden_size}→${m.intermediate_size}→${m.hidden_size}`,
    unembed: s ? (s.grammar ? `${fmtInt(s.grammar.allowed)} allowed` : `[${fmtInt(s.vocab)}] logits`) : "—",
    softmax: s ? `T = ${num(s.params.temperature)}` : "—",
    topp: s ? `${fmtInt(s.survivors.min_p)} left` : "—",
    sample: s ? `${quoted(s.token_text)} ${pct(s.prob)}` : "—",
    detok: s ? (s.is_stop ? "stop token" : JSON.stringify(s.text)) : "—",
    append: s ? `→ pos ${step.start + step.num_tokens}` : "—",
  };
}

/** Set a stage box's second line, shortened with "…" until it fits inside its box. */
function setShape(stage, text) {
  const node = document.querySelector(`[data-shape="${stage}"]`);
  const room = node.parentNode.querySelector("rect").width.baseVal.value - 10;
  node.textContent = text;
  for (let keep = text.length - 1; keep > 0 && node.getComputedTextLength() > room; keep -= 1) {
    node.textContent = `${text.slice(0, keep)}…`;
  }
}

/** Light the stages of one step; in slow motion one at a time. `onDetok` runs when the
 *  token is detokenized, so the text appears in the chat at that moment. */
async function walkPipeline(step, onDetok) {
  const owner = live;
  const delay = Number($("slowmo").value);
  const groups = document.querySelectorAll(".pipeline .stage");
  groups.forEach((g) => g.classList.remove("used", "active", "pulse"));
  const stages = stagesOf(step);
  const shapes = shapesOf(step);
  for (const name of PREFILL_STAGES) {
    setShape(name, delay > 0 && stages.includes(name) ? "…" : shapes[name]);
  }
  for (const name of stages) {
    const g = document.querySelector(`.stage[data-stage="${name}"]`);
    g.classList.add("used");
    setShape(name, shapes[name]);
    if (delay > 0) {
      g.classList.add("active");
      await sleep(delay);
      g.classList.remove("active");
      if (owner !== live) return; // "New chat" came during the walk
    } else {
      void g.getBoundingClientRect(); // restart the CSS animation
      g.classList.add("pulse");
    }
    if (name === "detok") onDetok();
  }
}

// ------------------------------------------------------------------ cards

function renderAll() {
  for (const card of document.querySelectorAll(".inspector .card")) {
    card.classList.toggle("has-data", run.steps.length > 0);
  }
  renderSequence();
  renderChoice();
  renderAttention();
  renderKV();
  renderTiming();
  renderSpeculation();
  renderTokenDetail();
  renderLayers();
  markSelected();
}

/** The header's live numbers, for the answer being streamed. */
function renderStats() {
  const s = live.summary;
  if (!s) return;
  $("stat-ttft").textContent = s.time_to_first_token_ms != null ? fmtMs(s.time_to_first_token_ms) : "–";
  $("stat-tps").textContent = s.decode_tokens_per_s ? `${s.decode_tokens_per_s.toFixed(1)} tok/s` : "–";
  $("stat-plain").textContent = "–"; // until the untraced re-run has timed this answer
  const kv = live.steps.at(-1)?.kv;
  if (kv) $("stat-kv").textContent = `${kv.tokens} tok · ${fmtBytes(kv.bytes)}`;
}

function select(pos) {
  run.selected = pos;
  if (run.header) renderAll();
}

function renderSequence() {
  const box = $("sequence");
  box.replaceChildren();
  const focus = focusPos();
  run.tokens.forEach((t, pos) => {
    const chip = el("span", `chip ${t.generated ? "generated" : "prompt"}`);
    chip.append(el("span", "", visible(t.text) || "∅"), el("span", "id", String(t.id)));
    chip.dataset.pos = pos;
    chip.title = `position ${pos} · id ${t.id} · piece ${t.piece}`;
    if (pos === focus) chip.classList.add("selected");
    box.append(chip);
  });
  const generated = run.tokens.filter((t) => t.generated).length;
  $("seq-count").textContent =
    `${plural(run.tokens.length - generated, "prompt token")} (chat template included) + ${generated} generated`;
  // keep the focused token (the newest one, or the clicked one) in the list's view
  const chip = box.querySelector(".chip.selected");
  if (chip) {
    const [c, b] = [chip.getBoundingClientRect(), box.getBoundingClientRect()];
    if (c.bottom > b.bottom) box.scrollTop += c.bottom - b.bottom + 30;
    else if (c.top < b.top) box.scrollTop -= b.top - c.top + 30;
  }
  markScroll();
}

/** A list longer than its card scrolls: fade the edges with more tokens past them and say so
 *  under the list (without this nothing showed that there was more). */
function markScroll() {
  const box = $("sequence");
  const more = box.scrollHeight - box.clientHeight > 1;
  const below = more && box.scrollTop + box.clientHeight < box.scrollHeight - 1;
  const above = more && box.scrollTop > 1;
  box.classList.toggle("more-below", below);
  box.classList.toggle("more-above", above);
  const hint = $("seq-scroll");
  hint.hidden = !more;
  hint.textContent = !more ? "" : below
    ? `The list scrolls: ${plural(run.tokens.length, "token")} in all, more below.`
    : `The list scrolls: ${plural(run.tokens.length, "token")} in all, scroll up for the first ones.`;
}

function markSelected() {
  const focus = focusPos();
  document.querySelectorAll(".bubble .tok.selected").forEach((n) => n.classList.remove("selected"));
  if (run.selected != null && run.bubble) {
    run.bubble.querySelector(`.tok[data-pos="${focus}"]`)?.classList.add("selected");
  }
}

function renderChoice() {
  const pos = focusPos();
  const token = run.tokens[pos];
  const alternatives = $("alternatives");
  alternatives.replaceChildren();
  $("funnel").replaceChildren();
  if (!token?.generated) {
    $("choice-where").textContent = "";
    $("choice-title").textContent = token
      ? `${quoted(token.text)} is part of the prompt: it was given, not chosen. Click a generated (green) token.`
      : "";
    return;
  }
  const step = run.steps[token.sampleStep];
  const s = sampleOf(token);
  $("choice-where").textContent = `position ${pos} · ${step.phase} step ${step.index}`;
  const title = $("choice-title");
  title.replaceChildren(
    "chose ", el("b", "", quoted(s.token_text)), ` (id ${s.token}) with p = `, el("b", "", pct(s.prob)),
    ` · rank ${s.rank} of ${fmtInt(s.vocab)} by logit · entropy ${s.entropy.toFixed(2)} → ` +
      `${s.entropy_after_temperature.toFixed(2)} bits after temperature`,
  );
  if (s.guess != null) {
    const guess = step.speculation.proposed_texts[token.sampleIndex];
    title.append(
      ` · the speculative guess here was ${quoted(guess)} (model's p = ${pct(s.guess_prob)}): `,
      el("b", "", s.guess_accepted ? "accepted" : "rejected"),
    );
  }
  renderFunnel(s);
  renderGrammarNote(s);
  // A masked candidate's bar is the model's own probability, which the grammar took away.
  const before = (c) => (c.allowed === false ? c.unconstrained_prob ?? 0 : c.prob);
  const top = Math.max(...s.candidates.map((c) => Math.max(before(c), c.final_prob)));
  for (const c of s.candidates) {
    const row = el("div", "cand");
    if (c.id === s.token) row.classList.add("chosen");
    if (c.allowed === false) row.classList.add("masked");
    else if (!c.kept) row.classList.add("cut");
    const text = el("span", "text", `${c.id === s.token ? "▶ " : ""}${quoted(c.text)}`);
    text.title = c.allowed === false
      ? `id ${c.id} · logit ${c.logit} · masked by the grammar; the model gave it ${pct(c.unconstrained_prob ?? 0)}`
      : `id ${c.id} · logit ${c.logit} · p before temperature ${pct(c.prob)} · after ${pct(c.scaled_prob)}`;
    const track = el("div", "track");
    const raw = el("div", "raw");
    raw.style.width = `${(before(c) / top) * 100}%`;
    const final = el("div", "final");
    final.style.width = `${(c.final_prob / top) * 100}%`;
    track.append(raw, final);
    let label = el("span", "pct", pct(c.final_prob));
    if (c.allowed === false) label = el("span", "pct masked-label", "masked");
    else if (!c.kept) label = el("span", "pct cut-label", "cut");
    row.append(text, track, label);
    alternatives.append(row);
  }
}

/** On a constrained step: how much of the vocabulary the grammar allowed, what it cut. */
function renderGrammarNote(s) {
  document.getElementById("grammar-note")?.remove();
  const g = s.grammar;
  if (!g) return;
  const masked = s.candidates.filter((c) => c.allowed === false).map((c) => quoted(c.text));
  const note = el(
    "div",
    "grammar-note",
    `${g.kind} grammar: ${fmtInt(g.allowed)} of ${fmtInt(g.vocab)} vocabulary entries allowed at this ` +
      `step; it masked ${masked.length ? masked.join(", ") : "none of the top candidates"}` +
      ` (${pct(g.masked_mass)} of the model's probability)`,
  );
  note.id = "grammar-note";
  $("funnel").before(note);
}

/** How many tokens survive each stage, as bars on a log scale. */
function renderFunnel(s) {
  const p = s.params;
  const rows = [
    ["vocabulary", s.vocab],
    [`top-k ${p.top_k || "off"}`, s.survivors.top_k],
    [`top-p ${num(p.top_p)}`, s.survivors.top_p],
    [`min-p ${num(p.min_p)}`, s.survivors.min_p],
  ];
  if (p.greedy) rows.splice(1, 3, ["greedy (argmax)", 1]);
  if (s.grammar) rows.splice(1, 0, [`grammar (${s.grammar.kind})`, s.grammar.allowed]);
  const full = Math.log(s.vocab + 1);
  for (const [label, count] of rows) {
    const row = el("div", label.startsWith("grammar") ? "stage-row grammar" : "stage-row");
    const bar = el("div", "bar");
    bar.style.width = `${(Math.log(count + 1) / full) * 100}%`;
    bar.append(el("span", "", plural(count, "token")));
    row.append(el("span", "", label), bar);
    $("funnel").append(row);
  }
}

// ---- attention

function fillLayerSelect(numLayers, current) {
  const select = $("layer");
  if (select.options.length === numLayers + 1) return;
  select.replaceChildren(el("option", "", "middle"));
  select.options[0].value = "";
  for (let i = 0; i < numLayers; i += 1) {
    const option = el("option", "", `layer ${i}`);
    option.value = String(i);
    select.append(option);
  }
  select.value = String(current);
}

/** query position -> that row's weights for `layer` and `head`, from the prefill rows (of a
 * long prompt only its last rows are traced) and the decode rows. */
function attentionRows(layer, head) {
  const rows = new Map();
  for (const step of run.steps) {
    // a verification's rows past its accepted guesses read tokens that were rolled back
    const last = step.speculation ? step.start + step.speculation.accepted : Infinity;
    for (const att of step.attention ?? []) {
      const h = att.heads.indexOf(head);
      if (att.layer !== layer || h < 0) continue;
      att.query_positions.forEach((q, r) => {
        if (q <= last) rows.set(q, att.weights[h][r]);
      });
    }
  }
  return rows;
}

function renderHeadButtons() {
  const box = $("heads");
  const n = run.header.model.num_heads;
  if (box.children.length !== n) {
    box.replaceChildren();
    for (let h = 0; h < n; h += 1) {
      const button = el("button", "", `head ${h}`);
      button.type = "button";
      button.addEventListener("click", () => {
        attentionHead = h;
        renderAttention();
      });
      box.append(button);
    }
  }
  [...box.children].forEach((b, h) => b.classList.toggle("on", h === attentionHead));
}

/** The query row behind the focused token: a generated token was chosen by the row before it. */
function focusQuery() {
  const pos = focusPos();
  return run.tokens[pos]?.generated ? pos - 1 : pos;
}

function renderAttention() {
  if (!run.header) return;
  renderHeadButtons();
  const layer = run.header.trace.layers[0]; // the page asks for one layer's maps
  const m = run.header.model;
  $("att-where").textContent =
    `layer ${layer} · head ${attentionHead} · ${plural(m.num_kv_heads, "K/V head")} shared by ` +
    `${plural(m.num_heads, "query head")}`;
  const rows = attentionRows(layer, attentionHead);
  const size = Math.max(1, run.tokens.length - (run.tokens.at(-1)?.generated ? 1 : 0));
  const canvas = $("heatmap");
  const { ctx, width } = fitCanvas(canvas);
  const stripe = 5;
  const cell = (width - stripe) / size;
  ctx.fillStyle = "#15171f";
  ctx.fillRect(0, 0, width, width);
  for (let i = 0; i < size; i += 1) {
    ctx.fillStyle = run.tokens[i]?.generated ? "#3cc8f5" : "#d17bff";
    ctx.fillRect(0, stripe + i * cell, stripe - 1, Math.max(1, cell));
    ctx.fillRect(stripe + i * cell, 0, Math.max(1, cell), stripe - 1);
  }
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(heatmapImage(rows, size), stripe, stripe, width - stripe, width - stripe);
  const q = focusQuery();
  if (q >= 0 && q < size) {
    ctx.strokeStyle = "#ffd54a";
    ctx.lineWidth = 1.5;
    ctx.strokeRect(stripe, stripe + q * cell, width - stripe, Math.max(2, cell));
  }
  canvas.onmousemove = (e) => describeCell(e, canvas, rows, stripe, cell);
  renderTopAttended(rows.get(q), q);
}

/** One pixel per (query, key) cell; masked cells stay transparent. */
function heatmapImage(rows, size) {
  const image = new ImageData(size, size);
  for (const [q, weights] of rows) {
    if (q >= size) continue;
    weights.forEach((w, k) => {
      if (k >= size) return; // a verification's row is as wide as its guesses' context
      const [r, g, b] = HEAT_LUT[Math.round(Math.sqrt(clamp01(w)) * 255)];
      image.data.set([r, g, b, 255], (q * size + k) * 4);
    });
  }
  const canvas = new OffscreenCanvas(size, size);
  canvas.getContext("2d").putImageData(image, 0, 0);
  return canvas;
}

function describeCell(event, canvas, rows, stripe, cell) {
  const box = canvas.getBoundingClientRect();
  const q = Math.floor((event.clientY - box.top - stripe) / cell);
  const k = Math.floor((event.clientX - box.left - stripe) / cell);
  const weights = rows.get(q);
  const [qt, kt] = [run.tokens[q], run.tokens[k]];
  if (!weights || !qt || !kt) return;
  $("att-hover").textContent = k > q
    ? `${quoted(qt.text)} (pos ${q}) cannot see ${quoted(kt.text)} (pos ${k}): masked, it comes later`
    : `${quoted(qt.text)} (pos ${q}) → ${quoted(kt.text)} (pos ${k}): weight ${weights[k].toFixed(3)}`;
}

function renderTopAttended(weights, q) {
  const box = $("att-top");
  box.replaceChildren();
  if (!weights) return;
  const token = run.tokens[q];
  const next = run.tokens[q + 1];
  const why = next?.generated ? `, choosing ${quoted(next.text)}` : "";
  box.append(el("div", "note", `${quoted(token.text)} (pos ${q}${why}) looked most at:`));
  // keys past q are masked (a verification's rows are as wide as its guesses' context)
  const top = weights.slice(0, q + 1).map((w, k) => [w, k]).sort((a, b) => b[0] - a[0]).slice(0, 4);
  for (const [w, k] of top) {
    const row = el("div", "row");
    const track = el("div", "track");
    const fill = el("div", "fill");
    fill.style.width = `${w * 100}%`;
    track.append(fill);
    row.append(el("span", "", `${quoted(run.tokens[k].text)} ${k}`), track, el("span", "", pct(w)));
    box.append(row);
  }
}

// ---- KV cache

function renderKV() {
  const step = run.steps.at(-1);
  if (!step) return;
  const kv = step.kv;
  const m = run.header.model;
  const blocks = $("kv-blocks");
  blocks.replaceChildren();
  // rows this step wrote that stay: a verification's rejected guesses were rolled back
  const fresh = kv.tokens - (kv.written - (kv.rolled_back ?? 0));
  for (let b = 0; b * m.block_size < kv.tokens; b += 1) {
    const block = el("div", "block");
    block.title = `block ${b}: positions ${b * m.block_size}…${(b + 1) * m.block_size - 1}`;
    for (let i = 0; i < m.block_size; i += 1) {
      const pos = b * m.block_size + i;
      const slot = el("div", "slot");
      if (pos < kv.tokens) slot.classList.add(pos >= fresh ? "fresh" : run.tokens[pos]?.generated ? "generated" : "prompt");
      block.append(slot);
    }
    blocks.append(block);
  }
  const text = $("kv-text");
  text.replaceChildren(
    el("b", "", String(kv.tokens)), ` ${kv.tokens === 1 ? "token" : "tokens"} × ${fmtBytes(m.kv_bytes_per_token)} ` +
      `(${plural(m.num_layers, "layer")} × K and V × ${plural(m.num_kv_heads, "head")} × ${m.head_dim} dims) = `,
    el("b", "", fmtBytes(kv.bytes)), ` in ${kv.blocks} block${kv.blocks === 1 ? "" : "s"} of ${m.block_size}; ` +
      `this step wrote ${kv.written} (yellow).` +
      (kv.rolled_back ? ` ${plural(kv.rolled_back, "rejected guess", "rejected guesses")}' rows were rolled back.` : "") +
      (kv.released ? " The answer is finished, so its blocks went back to the pool." : ""),
  );
  $("kv-pool").style.width = `${Math.max(0.5, (kv.pool_blocks_used / kv.pool_blocks_total) * 100)}%`;
  $("kv-pool-text").textContent =
    `pool (all requests): ${fmtInt(kv.pool_blocks_used)} of ${fmtInt(kv.pool_blocks_total)} blocks in use · ` +
    `capacity ${fmtInt(m.kv_capacity_tokens)} tokens = ${fmtBytes(m.kv_capacity_bytes)}`;
}

// ---- timing

function renderTiming() {
  if (!run.steps.length) return;
  const { ctx, width, height } = fitCanvas($("timing"));
  ctx.clearRect(0, 0, width, height);
  const times = run.steps.map((s) => s.step_ms);
  const top = Math.max(...times);
  const slots = Math.max(times.length, 24);
  const barWidth = (width - 40) / slots;
  ctx.font = "10px ui-monospace, monospace";
  ctx.fillStyle = "#8891a5";
  ctx.fillText(fmtMs(top), 0, 10);
  ctx.fillText("0", 0, height - 14);
  run.steps.forEach((s, i) => {
    const h = (s.step_ms / top) * (height - 30);
    ctx.fillStyle = s.phase === "prefill" ? "#d17bff" : s.phase === "verify" ? "#7ee08a" : "#3cc8f5";
    ctx.fillRect(40 + i * barWidth, height - 14 - h, Math.max(1, barWidth - 2), h);
  });
  ctx.fillStyle = "#8891a5";
  ctx.fillText("one bar per engine step →", 40, height - 2);
  const prefill = run.steps.filter((s) => s.phase === "prefill");
  const decode = run.steps.filter((s) => s.phase === "decode");
  const prefillTokens = prefill.reduce((n, s) => n + s.num_tokens, 0);
  const prefillMs = prefill.reduce((t, s) => t + s.step_ms, 0);
  const box = $("timing-text");
  box.replaceChildren(
    "prefill ", el("b", "", `${plural(prefillTokens, "token")} in ${fmtMs(prefillMs)}`),
    ` (${fmtInt(Math.round((prefillTokens / prefillMs) * 1000))} tok/s: one big matrix multiply per weight)`,
  );
  if (decode.length) {
    const each = median(decode.map((s) => s.step_ms));
    box.append(
      " · decode ", el("b", "", `${fmtMs(each)} per token`),
      ` (${(1000 / each).toFixed(1)} tok/s: every weight is read again for a single token)`,
    );
  }
  const verify = run.steps.filter((s) => s.phase === "verify");
  if (verify.length) {
    const tokens = verify.reduce((n, s) => n + s.speculation.emitted, 0);
    box.append(
      " · verify (green) ", el("b", "", `${fmtMs(median(verify.map((s) => s.step_ms)))} per step`),
      `, ${(tokens / verify.length).toFixed(2)} tokens per step`,
    );
  }
}

// ---- speculation

/** Each verification step: its guesses (accepted, rejected, not reached), the tokens it
 *  emitted, and its time beside a plain decode step's. Its explanation until one ran. */
function renderSpeculation() {
  const verify = run.steps.filter((s) => s.phase === "verify");
  $("card-spec").classList.toggle("has-data", verify.length > 0); // else its explanation
  showSpecCard();
  if (!verify.length) return;
  const list = $("spec-steps");
  list.replaceChildren();
  for (const step of verify.slice(-12)) {
    const sp = step.speculation;
    const row = el("div", "spec-step");
    row.append(el("span", "spec-index", `step ${step.index}`));
    sp.proposed_texts.forEach((text, j) => {
      const sample = step.samples[j];
      const state = !sample ? "unreached" : sample.guess_accepted ? "accepted" : "rejected";
      const chip = el("span", `guess ${state}`, visible(text) || "∅");
      chip.title = !sample
        ? "not reached: an earlier guess was rejected or the answer stopped"
        : `${state}: the model gave it ${pct(sample.guess_prob)}` +
          (sample.guess_accepted ? "" : `; it chose ${quoted(sample.token_text)}`);
      row.append(chip);
    });
    const own = step.samples.length > sp.proposed.length ? step.samples.at(-1) : null;
    const bonus = own ?? (step.samples.at(-1)?.guess_accepted ? null : step.samples.at(-1));
    if (bonus) row.append(el("span", "guess own", `→ ${visible(bonus.token_text)}`));
    const cost = sp.step_vs_plain ? ` (${sp.step_vs_plain.toFixed(2)}× a plain step)` : "";
    row.append(el("span", "spec-cost", `${fmtMs(step.step_ms)}${cost} → ${plural(sp.emitted, "token")}`));
    list.append(row);
  }
  const accepted = verify.reduce((n, s) => n + s.speculation.accepted, 0);
  const proposed = verify.reduce((n, s) => n + s.speculation.proposed.length, 0);
  const emitted = verify.reduce((n, s) => n + s.speculation.emitted, 0);
  const engineCost = verify.at(-1).speculation.engine_verify_cost;
  $("spec-text").textContent =
    `${plural(verify.length, "verification step")}: ${accepted} of ${proposed} guesses accepted ` +
    `(${pct(proposed ? accepted / proposed : 0)}), ${(emitted / verify.length).toFixed(2)} tokens per step. ` +
    "Each one runs the last token and the guesses as rows of one pass over the weights; a row's token is " +
    "drawn as a plain step would draw it, and kept while it equals the guess." +
    (engineCost ? ` Untraced, on the fused decode stack, a verification costs ${engineCost.toFixed(2)}× a plain step.` : "");
}

// ---- token detail

function renderTokenDetail() {
  const pos = focusPos();
  const token = run.tokens[pos];
  const box = $("token-detail");
  if (!token) return;
  $("token-where").textContent = `position ${pos}`;
  box.replaceChildren(
    el("div", "big", visible(token.text) || "∅"),
    el("div", "facts", `id ${token.id} · piece ${JSON.stringify(token.piece)} · ` +
      `${token.generated ? "generated" : "prompt"} · position ${pos}`),
  );
  const step = run.steps[token.inputStep];
  if (!step) {
    box.append(el("div", "", "Not fed back yet: its embedding is looked up in the next step."));
    return;
  }
  const row = pos - step.start;
  const sample = step.embedding?.sample[row];
  if (sample) {
    box.append(el("h3", "", `embedding: the first ${sample.length} of ${step.embedding.shape[1]} numbers (‖x‖ = ${step.embedding.norms[row]})`));
    box.append(dimBars(sample));
  }
  const pe = step.position_encoding;
  if (pe?.kind === "rope" && pe.angles[row]) {
    box.append(el("h3", "", `RoPE: q and k are rotated pairwise by position × θᵢ`));
    box.append(clocks(pe, row, pos));
  } else if (pe?.kind === "learned" && pe.sample[row]) {
    box.append(el("h3", "", `learned position vector added (first ${pe.sample[row].length} numbers)`));
    box.append(dimBars(pe.sample[row]));
  }
}

function dimBars(values) {
  const wrap = el("div");
  const bars = el("div", "dims");
  const labels = el("div", "dim-labels");
  const top = Math.max(...values.map(Math.abs)) || 1;
  for (const v of values) {
    const dim = el("div", "dim");
    const bar = el("div", `v ${v >= 0 ? "pos" : "neg"}`);
    bar.style.height = `${(Math.abs(v) / top) * 50}%`;
    dim.append(bar);
    bars.append(dim);
    labels.append(el("span", "", v.toFixed(3)));
  }
  wrap.append(bars, labels);
  return wrap;
}

function clocks(pe, row, pos) {
  const box = el("div", "clocks");
  pe.angles[row].slice(0, 6).forEach((angle, i) => {
    const item = el("div", "clock");
    const canvas = el("canvas");
    canvas.style.width = canvas.style.height = "46px";
    item.append(canvas, el("span", "", `θ${i}=${pe.inv_freq[i].toFixed(3)}`), el("span", "", `${pos}·θ${i}=${angle.toFixed(2)}`));
    box.append(item);
    requestAnimationFrame(() => drawClock(canvas, angle));
  });
  return box;
}

function drawClock(canvas, angle) {
  const { ctx, width } = fitCanvas(canvas);
  const c = width / 2;
  const r = c - 3;
  ctx.strokeStyle = "#3a4255";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  ctx.arc(c, c, r, 0, 2 * Math.PI);
  ctx.stroke();
  ctx.strokeStyle = "#56607a";
  ctx.beginPath();
  ctx.moveTo(c, c);
  ctx.lineTo(c + r, c);
  ctx.stroke();
  ctx.strokeStyle = "#ffd54a";
  ctx.lineWidth = 2.5;
  ctx.beginPath();
  ctx.moveTo(c, c);
  ctx.lineTo(c + r * Math.cos(angle), c - r * Math.sin(angle));
  ctx.stroke();
}

// ---- layers

function renderLayers() {
  const step = stepFor(focusPos());
  const box = $("layers");
  box.replaceChildren();
  if (!step?.layers?.length) return;
  const last = run.tokens[step.start + step.num_tokens - 1];
  $("layers-where").textContent =
    `${step.phase} step ${step.index} · the row of ${quoted(last?.text ?? "")}`;
  const top = Math.max(...step.layers.flatMap((l) => [l.attention_update_norm, l.mlp_update_norm]));
  for (const layer of step.layers) {
    const row = el("div", "layer-row");
    row.title = `layer ${layer.layer}: attention adds ‖${layer.attention_update_norm}‖, ` +
      `the MLP adds ‖${layer.mlp_update_norm}‖; ‖x‖ after = ${layer.mlp_residual_norm}`;
    const bars = [["attn", layer.attention_update_norm], ["mlp", layer.mlp_update_norm]].map(([kind, v]) => {
      const track = el("div", "track");
      const fill = el("div", kind);
      fill.style.width = `${(v / top) * 100}%`;
      track.append(fill);
      return track;
    });
    const cells = el("div", "cells");
    layer.max.forEach((w, h) => {
      const cell = el("span", "cell");
      cell.style.background = heat(w);
      cell.title = `head ${h}: peak weight ${w}, entropy ${layer.entropy[h]} bits`;
      cells.append(cell);
    });
    row.append(el("span", "n", String(layer.layer)), ...bars, cells);
    box.append(row);
  }
}

// ------------------------------------------------------------------ chat

function settings() {
  const layer = $("layer").value;
  return {
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    top_k: Number($("top_k").value),
    max_tokens: Number($("max_tokens").value),
    ...(layer === "" ? {} : { layer: Number(layer) }),
    ...($("model-picker").value ? { model: $("model-picker").value } : {}),
  };
}

/** The structured-output constraint chosen in the settings, as /v1/inspect names it. */
function constraint() {
  const kind = $("constraint").value;
  const text = $("constraint_value").value.trim();
  if (kind === "json_schema") return { json_schema: text || "{}" };
  if (kind === "regex") return { regex: text };
  if (kind === "choice") return { choice: text.split("\n").map((c) => c.trim()).filter(Boolean) };
  return {};
}

/** The same constraint in /v1/chat/completions' (vLLM's) names. */
function guided() {
  const c = constraint();
  if (c.json_schema !== undefined) return { guided_json: c.json_schema };
  if (c.regex !== undefined) return { guided_regex: c.regex };
  if (c.choice !== undefined) return { guided_choice: c.choice };
  return {};
}

function addBubble(role, text) {
  const bubble = el("div", `bubble ${role}`, text);
  $("messages").append(bubble);
  $("messages").scrollTop = $("messages").scrollHeight;
  return bubble;
}

// JSON headers, plus the bearer token when the user gave one (kept in this browser only).
function apiHeaders() {
  const key = $("api_key").value.trim();
  localStorage.setItem("tokenmill-api-key", key);
  const headers = { "Content-Type": "application/json" };
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

/** The header's model line before any answer: the served name and context from GET /v1/models
 *  (the first traced answer's "start" event then adds the model's shape). */
async function showServedModel() {
  const line = $("model-name");
  try {
    const response = await fetch("/v1/models", { headers: apiHeaders() });
    if (response.status === 401) {
      line.textContent = $("api_key").value.trim()
        ? "model: this server refused the API key in the settings"
        : "model: enter this server's API key (in the settings) to see it";
      return;
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    const cards = (await response.json()).data;
    fillModelPicker(cards);
    const card = cards.find((c) => c.id === $("model-picker").value) ?? cards[0];
    servedName = card.id;
    if (!live.header && !run.header) showCard(card);
  } catch (err) {
    line.textContent = `model: unknown (GET /v1/models failed: ${err.message})`;
  }
  await learnSpeculation();
}

/** Whether the chosen model speculates, from GET /metrics (open even behind an API key): a
 *  speculating engine reports tokenmill_spec_decode_* series labelled with its method, one
 *  that does not has none. A model not loaded yet reports nothing: its card shows once an
 *  answer has verification steps. */
async function learnSpeculation() {
  speculation = null;
  try {
    const response = await fetch("/metrics");
    if (response.ok) {
      const chosen = $("model-picker").value;
      for (const line of (await response.text()).split("\n")) {
        const series = /^tokenmill_spec_decode_num_drafts_total\{([^}]*)\}/.exec(line);
        if (!series) continue;
        const labels = Object.fromEntries(
          [...series[1].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)].map(([, k, v]) => [k, v]),
        );
        // one model: no model label; several: the chosen one's
        if (labels.model === undefined || labels.model === chosen) speculation = labels.method ?? "";
      }
    }
  } catch {
    // no /metrics to read: the card shows if an answer verifies guesses
  }
  $("card-spec").dataset.server = speculation === null ? "no speculation" : "speculates";
  showSpecCard();
}

/** What the prefix cache does for the whole server, from GET /metrics: the share of prompt
 *  tokens it served and, with --prefix-cache-dir, the blocks on disk and the prompt tokens
 *  read back from them (after a restart); after each answer, as the pool line beside it.
 *  An inspected request itself never hits: it runs under a private cache root. */
async function learnCacheRates() {
  try {
    const response = await fetch("/metrics");
    if (!response.ok) return;
    const chosen = $("model-picker").value;
    const values = {};
    const series = /^(tokenmill_prefix_cache_(?:hit_rate|disk_hit_tokens_total|disk_blocks))(?:\{([^}]*)\})? (\S+)$/;
    for (const line of (await response.text()).split("\n")) {
      const found = series.exec(line);
      if (!found) continue;
      const model = found[2] ? /model="((?:[^"\\]|\\.)*)"/.exec(found[2])?.[1] : undefined;
      if (model === undefined || model === chosen) values[found[1]] = Number(found[3]);
    }
    const rate = values.tokenmill_prefix_cache_hit_rate;
    if (rate === undefined) return;
    let text = `prefix cache (all requests): ${(rate * 100).toFixed(0)}% of prompt tokens served from it`;
    const onDisk = values.tokenmill_prefix_cache_disk_blocks;
    if (onDisk) {
      const read = values.tokenmill_prefix_cache_disk_hit_tokens_total ?? 0;
      text += ` · on disk: ${plural(onDisk, "block")}, ${plural(read, "prompt token")} read back`;
    }
    $("kv-cache-text").textContent = text;
  } catch {
    // no /metrics to read: the line stays empty
  }
}

/** The speculative-decoding card only where it can ever show something: on a server that
 *  speculates, or for an answer that verified guesses. */
function showSpecCard() {
  const verified = run.steps.some((s) => s.phase === "verify");
  $("card-spec").hidden = speculation === null && !verified;
  const method = speculation || run.steps.find((s) => s.speculation)?.speculation.method;
  $("spec-method").textContent = `${method ? `${method}: ` : ""}guesses verified in one step`;
}

/** The header's line for a model card: its context, or that it loads on first use. */
function showCard(card) {
  $("model-name").textContent =
    card.max_model_len == null
      ? `${card.id} · not loaded yet (it loads on its first message)`
      : `${card.id} · context ${plural(card.max_model_len, "token")}`;
}

/** A server with several models (tokenmill serve --model A --model B): a picker of every one
 *  GET /v1/models lists, keeping the choice; the chosen name goes in each request's `model`.
 *  With one model the picker stays hidden and requests name none, as before. */
function fillModelPicker(cards) {
  const picker = $("model-picker");
  const chosen = picker.value;
  picker.replaceChildren(
    ...cards.map((c) => {
      const option = el("option", "", c.loaded === false ? `${c.id} (not loaded)` : c.id);
      option.value = c.id;
      return option;
    }),
  );
  if (cards.some((c) => c.id === chosen)) picker.value = chosen;
  $("model-pick").style.display = cards.length < 2 ? "none" : ""; // (a label's CSS display beats `hidden`)
  if (cards.length < 2) picker.replaceChildren();
  picker.onchange = () => {
    const card = cards.find((c) => c.id === picker.value);
    servedName = card.id;
    if (!live.header && !run.header) showCard(card);
    learnSpeculation();
  };
}

// What the inspector shows before the first answer, taken from index.html as the page loads,
// so that "New chat" puts back exactly that.
const PRISTINE = [
  "phase", "phase-detail", "stat-ttft", "stat-tps", "stat-plain", "stat-kv", "sequence", "seq-count",
  "choice-where", "choice-title", "funnel", "alternatives", "att-where", "heads", "att-hover",
  "att-top", "kv-text", "kv-blocks", "kv-pool-text", "kv-cache-text", "timing-text", "token-where", "token-detail",
  "layers-where", "layers",
].map((id) => [$(id), $(id).innerHTML, $(id).className]);
const PRISTINE_SHAPES = [...document.querySelectorAll("[data-shape]")].map((n) => [n, n.textContent]);

/** Back to the empty inspector: no answer's numbers, maps or tokens left anywhere. */
function clearInspector() {
  untraced.abort();
  player.queue.length = 0;
  live = run = newRun(null);
  resetCards();
}

/** The cards and numbers as before the first answer. A new request starts here too: until
 *  its first step arrives (a long prompt's prefill takes a while) the cards showed the
 *  previous answer as if it were this one's. */
function resetCards() {
  for (const [node, html, className] of PRISTINE) {
    node.innerHTML = html;
    node.className = className;
  }
  for (const [node, text] of PRISTINE_SHAPES) node.textContent = text;
  document.getElementById("grammar-note")?.remove();
  document.querySelectorAll(".pipeline .stage").forEach((g) => g.classList.remove("used", "active", "pulse"));
  $("pipeline").classList.remove("prefill", "decode", "verify");
  $("kv-pool").style.width = "";
  for (const canvas of [$("heatmap"), $("timing")]) {
    canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
  }
  $("heatmap").onmousemove = null;
  document.querySelectorAll(".inspector .card").forEach((c) => c.classList.remove("has-data"));
  $("sequence").scrollTop = 0;
  markScroll();
  showSpecCard();
}

async function inspectAnswer(bubble) {
  live = run = newRun(bubble);
  runs.set(bubble, live);
  resetCards();
  $("phase").textContent = "sent";
  $("phase-detail").textContent = "waiting for the engine's first step: the prompt's prefill";
  // kept for the untraced re-run: the same messages, settings and constraint
  live.request = { ...settings(), ...guided(), messages: [...history] };
  const response = await fetch("/v1/inspect", {
    method: "POST",
    signal: conversation.signal,
    headers: apiHeaders(),
    body: JSON.stringify({
      ...settings(), ...constraint(), messages: live.request.messages, head: null, stream: true,
    }),
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  let text = "";
  let failure = null;
  for await (const event of readEvents(response)) {
    if (event.type === "error") failure = event.error.message;
    else enqueue(event);
    if (event.type === "done") text = event.text;
  }
  await playerIdle();
  if (failure) throw new Error(failure);
  return text;
}

/** Stream one plain (untraced) chat answer to `request` (settings, messages and a constraint
 *  in /v1/chat/completions' names). onDelta(kind, text) gets each piece of content or reasoning; onTiming(rate) the decode rate so far. Returns {text, finish, tokens, rate}:
 *  rate is the tokens after the first over the time from the first to the last chunk, in
 *  tokens/s (null for an answer of one token), from the usage the server reports. */
async function plainStream(request, signal, onDelta = () => {}, onTiming = () => {}) {
  const { layer, ...params } = request;
  const started = performance.now();
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    signal,
    headers: apiHeaders(),
    body: JSON.stringify({
      ...params, stream: true, stream_options: { include_usage: true },
    }),
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  let text = "";
  let first = null;
  let last = null;
  let chunks = 0;
  let finish = null;
  let tokens = null;
  for await (const chunk of readEvents(response)) {
    if (chunk.error) throw new Error(chunk.error.message);
    const choice = chunk.choices?.[0];
    if (choice?.finish_reason) {
      finish = choice.finish_reason;
      last = performance.now();
    }
    if (chunk.usage) tokens = chunk.usage.completion_tokens;
    const reasoning = choice?.delta?.reasoning_content;
    if (reasoning) onDelta("reasoning", reasoning);
    const delta = choice?.delta?.content;
    if (!delta) continue;
    first ??= performance.now();
    chunks += 1;
    text += delta;
    onDelta("content", delta, first - started);
    const elapsed = (performance.now() - first) / 1000;
    if (chunks > 1 && elapsed > 0) onTiming((chunks - 1) / elapsed);
  }
  const span = first != null && last != null ? (last - first) / 1000 : 0;
  const rate = tokens > 1 && span > 0 ? (tokens - 1) / span : null;
  return { text, finish, tokens, rate };
}

const tokPerS = (rate) => `${rate.toFixed(1)} tok/s`;

async function plainAnswer(bubble) {
  live = run = newRun(null);
  resetCards();
  $("phase").textContent = "not traced";
  $("phase-detail").textContent =
    "plain chat: nothing to draw (click a traced answer's token to inspect that one again)";
  const request = { ...settings(), ...guided(), messages: [...history] };
  let thinking = null; // a reasoning model's thinking, folded in a <details> above the answer
  const onDelta = (kind, text, firstMs) => {
    if (kind === "reasoning") {
      if (!thinking) {
        const details = el("details", "thinking");
        details.append(el("summary", "", "thinking"));
        thinking = details.appendChild(el("span", "thought"));
        bubble.append(details);
      }
      thinking.textContent += text;
      return;
    }
    bubble.append(el("span", "tok", text));
    $("stat-ttft").textContent = fmtMs(firstMs);
  };
  const onTiming = (rate) => ($("stat-plain").textContent = tokPerS(rate));
  const answer = await plainStream(request, conversation.signal, onDelta, onTiming);
  if (answer.rate) $("stat-plain").textContent = tokPerS(answer.rate);
  if (answer.finish === "length") bubble.append(cutMark(answer.tokens ?? 0, request.max_tokens));
  bubble.append(el("span", "meta",
    "plain chat" + (answer.rate ? ` · ${tokPerS(answer.rate)} untraced` : "") +
      " · turn tracing on to inspect the engine"));
  return answer.text;
}

/** The engine's own decode speed for a traced answer: the same request sent again without a
 *  trace (at most UNTRACED_TOKENS), timed, and shown beside the traced speed. Tracing runs
 *  every step on the slow unfused path, so the traced figure alone read as a slow engine. */
const UNTRACED_TOKENS = 64;

async function timeUntraced(owner, meta) {
  untraced.abort();
  untraced = new AbortController();
  const { signal } = untraced;
  const request = { ...owner.request, max_tokens: Math.min(owner.request.max_tokens, UNTRACED_TOKENS) };
  $("stat-plain").textContent = "timing…";
  $("stat-plain").title = "";
  try {
    const { rate } = await plainStream(request, signal);
    if (signal.aborted || owner !== live) return;
    $("stat-plain").textContent = rate ? tokPerS(rate) : "–";
    if (rate) meta.textContent += ` · ${tokPerS(rate)} untraced`;
  } catch (err) {
    if (signal.aborted || owner !== live) return;
    $("stat-plain").textContent = "–";
    $("stat-plain").title = `the untraced re-run failed: ${err.message}`;
  }
}

async function send(text) {
  untraced.abort(); // the last answer's untraced re-run must not share the engine with this one
  $("send").disabled = true;
  const { signal } = conversation;
  history.push({ role: "user", content: text });
  addBubble("user", text);
  const bubble = addBubble("assistant", "");
  try {
    const answer = $("trace").checked ? await inspectAnswer(bubble) : await plainAnswer(bubble);
    if (!signal.aborted) history.push({ role: "assistant", content: answer });
  } catch (err) {
    if (signal.aborted) return; // "New chat" dropped this answer, and its bubble with it
    history.pop();
    bubble.classList.add("error");
    bubble.textContent = `error: ${err.message}`;
  } finally {
    $("send").disabled = false;
  }
}

// ------------------------------------------------------------------ wiring

function bindOutput(id, format = (v) => v) {
  const input = $(id);
  const show = () => ($(`${id}-out`).textContent = format(input.value));
  input.addEventListener("input", show);
  show();
}

function onTokenClick(event) {
  const target = event.target.closest("[data-pos]");
  if (!target) return;
  const bubble = target.closest(".bubble");
  if (bubble) run = runs.get(bubble) ?? run;
  if (run.header) select(Number(target.dataset.pos));
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || $("send").disabled) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

const PRISTINE_MESSAGES = $("messages").innerHTML;

$("reset").addEventListener("click", () => {
  conversation.abort();
  conversation = new AbortController();
  history.length = 0;
  $("messages").innerHTML = PRISTINE_MESSAGES;
  clearInspector();
});

$("messages").addEventListener("click", onTokenClick);
$("sequence").addEventListener("click", onTokenClick);
$("sequence").addEventListener("scroll", markScroll);
window.addEventListener("resize", () => run.header && renderAll());

// The constraint box shows once a kind is chosen, with an example of that kind.
const CONSTRAINT_EXAMPLES = {
  json_schema: '{"type": "object", "properties": {"answer": {"type": "string"}}}',
  regex: "(yes|no), because [a-z ]+\\.",
  choice: "yes\nno\nmaybe",
};
function showConstraintBox() {
  const kind = $("constraint").value;
  $("constraint-box").hidden = !kind;
  if (kind) $("constraint_value").placeholder = CONSTRAINT_EXAMPLES[kind];
}
$("constraint").addEventListener("change", showConstraintBox);
showConstraintBox();

bindOutput("temperature");
bindOutput("top_p");
bindOutput("slowmo", (v) => (Number(v) ? `${v} ms per stage` : "off (live)"));

$("api_key").value = localStorage.getItem("tokenmill-api-key") || "";
$("api_key").addEventListener("change", showServedModel);
showServedModel();
