"""The terminal view of a trace: what `tokenmill inspect` (cli/inspect.py) prints.

The prefill is printed in full (tokenize, embed, positions, Q/K/V, the KV cache
write, masked attention as a heatmap, the MLP, un-embedding, softmax with
temperature, the top-k/top-p/min-p cuts, sampling, detokenization, feeding the
token back); each decode step then gets a compact view of the same loop. Steps
are printed as the engine finishes them, from a `Trace` (inspect/trace.py), through
`TerminalView.show_step`; the records it reads are declared in inspect/schema.py.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tokenmill.inspect.schema import ModelRecord, StepRecord
from tokenmill.units import format_bytes, format_rate

HEATMAP_MAX_TOKENS = 24  # heatmap rows/columns shown in the terminal (the newest tokens)
TABLE_ENDS = 4  # a per-token table of a longer prompt shows this many rows at each end
BAR_WIDTH = 24
PARTIAL_BLOCKS = " ▏▎▍▌▋▊▉"
# Heat cells carry their value as a shade character as well as a colour, so a plain
# capture (a pipe, NO_COLOR, a screen reader) still shows the pattern.
SHADES = " ░▒▓█"
DEFAULT_SEED = 0  # a fixed seed by default: two runs of the same command show the same trace


# ---------------------------------------------------------------------- drawing helpers


def _cut_label(candidate: dict[str, Any]) -> Text:
    """Why a candidate cannot be drawn: the grammar masked it, or a filter cut it."""
    if not candidate.get("allowed", True):
        return Text("masked", style="magenta")
    return Text("cut", style="red")


def visible(text: str) -> str:
    """Token text with its whitespace made visible."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")


def heat_style(weight: float) -> str:
    """Colour for an attention weight, dark blue (0) to bright yellow (1), as both the
    foreground and background of a cell: on a colour terminal the cell is a solid block
    of colour, while its shade character (`heat_cell`) shows in a plain capture.

    A square-root scale, so the small weights most heads spread around stay visible
    next to the large weight many heads park on the first token."""
    w = max(0.0, min(1.0, weight)) ** 0.5
    r, g, b = int(20 + 235 * w), int(24 + 200 * w), int(60 + 40 * (1 - w))
    return f"rgb({r},{g},{b}) on rgb({r},{g},{b})"


def shade(weight: float) -> str:
    """One of ' ░▒▓█' for a weight in [0, 1], on the colours' square-root scale."""
    w = max(0.0, min(1.0, weight)) ** 0.5
    return SHADES[round(w * (len(SHADES) - 1))]


def heat_cell(weight: float, width: int = 2) -> Text:
    return Text(shade(weight) * width, style=heat_style(weight))


def bar(fraction: float, width: int = BAR_WIDTH, style: str = "green") -> Text:
    """A horizontal bar drawn with eighth-blocks."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    body = "█" * full + (PARTIAL_BLOCKS[part] if part else "")
    return Text(body.ljust(width), style=style)


ID_MARK = "·"  # between a token and its id: `The·504 ␣capital·3575`, plain or in colour


def token_chips(texts: list[str], ids: list[int] | None = None) -> Text:
    """Tokens as alternating coloured chips, the way a tokenizer cuts the text, each one
    followed by ·id. The mark keeps a token's text and its id apart in a plain capture,
    where the chips have no colour ("The504" read as one token); visible() shows a
    token's spaces as ␣, so a line wraps between chips, never inside one."""
    out = Text()
    palette = ["black on rgb(170,210,255)", "black on rgb(255,214,160)"]
    for i, t in enumerate(texts):
        out.append(visible(t), style=palette[i % 2])
        if ids is not None:
            out.append(f"{ID_MARK}{ids[i]}", style="dim")
        out.append(" ")
    return out


def table_rows(count: int) -> list[int | None]:
    """Row indices to print for `count` rows: all, or both ends with None for the gap."""
    if count <= 2 * TABLE_ENDS + 1:
        return list(range(count))
    return [*range(TABLE_ENDS), None, *range(count - TABLE_ENDS, count)]


def heatmap(att: dict[str, Any], labels: list[str]) -> Table:
    """The attention matrix of the first recorded head as coloured cells; masked (future)
    cells are dots. Only the newest HEATMAP_MAX_TOKENS rows and columns fit."""
    weights = att["weights"][0]  # [L][C]
    queries = att["query_positions"]
    first = max(0, att["context"] - HEATMAP_MAX_TOKENS)
    table = Table.grid(padding=(0, 0))
    table.add_column(justify="right", no_wrap=True)
    table.add_column(width=1)  # a gap: right-justified text loses its trailing space
    for _ in range(first, att["context"]):
        table.add_column(width=2, no_wrap=True)
    for row, q in enumerate(queries):
        if q < first:
            continue
        cells = [
            heat_cell(w) if k <= q else Text(" ·", style="dim")
            for k, w in enumerate(weights[row][first:], start=first)
        ]
        table.add_row(Text(f"{visible(labels[q])[:12]} {q:>3}", style="bold"), "", *cells)
    return table


def attention_strip(att: dict[str, Any]) -> Text:
    """One decode step's attention row as a strip of coloured cells, oldest key first."""
    row = att["weights"][0][-1]
    shown = row[-HEATMAP_MAX_TOKENS * 2 :]
    out = Text("…" if len(shown) < len(row) else "")
    for w in shown:
        out.append_text(heat_cell(w, width=1))
    return out


def _map(step: StepRecord) -> dict[str, Any] | None:
    """The step's attention map (the one layer and head the command asks for), if the step
    holds rows of it (a long prompt's map keeps only its last rows)."""
    maps = step.get("attention")
    return maps[0] if maps else None


def head_cells(values: list[float]) -> Text:
    """One shaded, coloured cell per head, for values in [0, 1]."""
    out = Text()
    for v in values:
        out.append_text(heat_cell(v))
    return out


def print_table(console: Console, table: Table) -> None:
    """Print `table` at its natural width even where that is wider than the console: a
    table squeezed to 80 columns folds its cells onto extra lines and cannot be read,
    while a long line only runs past the edge."""
    natural = Measurement.get(console, console.options.update_width(1000), table).maximum
    if natural <= console.width:
        console.print(table)
        return
    width = console.width  # print(width=...) cannot exceed the console's width: widen it
    console.width = natural
    try:
        console.print(table, crop=False)
    finally:
        console.width = width


def prefill_vs_decode(prefill_tokens: int, prefill_rate: float, summary: dict[str, Any]) -> str:
    """The lesson of the timing table, in words that match the figures just printed."""
    why = (
        "Prefill pushes all prompt tokens through the model as one matrix, so its cost is "
        "shared; decode runs the whole model for one token at a time, reading every weight "
        "and the KV cache each step."
    )
    decode_rate = summary.get("decode_tokens_per_s") or 0.0
    if not summary["decode_ms"] or not decode_rate or not prefill_rate:
        return why
    ratio = prefill_rate / decode_rate
    if ratio >= 1.5:
        return f"{why} Here prefill ran {ratio:.1f}x faster per token than decode."
    return (
        f"{why} Here prefill ran {format_rate(prefill_rate)} tok/s against decode's "
        f"{format_rate(decode_rate)}: {prefill_tokens} prompt token(s) are too few to share "
        "much work; a longer prompt shows the gap."
    )


# ---------------------------------------------------------------------- the view


class TerminalView:
    """Prints trace steps as they arrive: the first prefill in full, decode steps compact."""

    def __init__(self, console: Console, seed: int | None = None):
        self.console = console
        self.seed = seed
        self.tokens: list[str] = []  # text of every token so far, by position
        self.decode_header_shown = False

    # -- entry points ---------------------------------------------------
    def show_step(self, trace, step: StepRecord) -> None:
        if step["index"] == 0:
            self._intro(trace)
        if step["phase"] == "prefill":
            self._prefill(trace, step)
        elif step["phase"] == "verify":
            self._verify(trace, step)
        else:
            self._decode(trace, step)

    def show_summary(self, trace) -> None:
        s, c = trace.summary, self.console
        c.rule("[bold]Timing: prefill vs decode")
        prefill_tokens = sum(st["num_tokens"] for st in trace.steps if st["phase"] == "prefill")
        table = Table(box=None, padding=(0, 2))
        table.add_column("phase", style="bold")
        table.add_column("tokens", justify="right")
        table.add_column("time", justify="right")
        table.add_column("speed", justify="right")
        table.add_column("")
        slowest = max([s["prefill_ms"], *s["decode_ms"]]) or 1.0
        pre_rate = prefill_tokens / s["prefill_ms"] * 1000 if s["prefill_ms"] else 0.0
        table.add_row(
            "prefill",
            str(prefill_tokens),
            f"{s['prefill_ms']:.1f} ms",
            f"{format_rate(pre_rate)} tok/s",
            bar(s["prefill_ms"] / slowest, style="magenta"),
        )
        emitted = s.get("decode_tokens") or [1] * len(s["decode_ms"])
        for i, (ms, n) in enumerate(zip(s["decode_ms"], emitted, strict=True), start=1):
            table.add_row(
                f"decode {i}",
                str(n),  # more than 1: a verification accepted guesses
                f"{ms:.1f} ms",
                f"{format_rate(n * 1000 / ms)} tok/s",
                bar(ms / slowest, style="cyan"),
            )
        print_table(c, table)
        ttft = s["time_to_first_token_ms"]
        c.print(
            f"time to first token [bold]{ttft:.1f} ms[/bold]"
            + (
                f" · decode [bold]{format_rate(s['decode_tokens_per_s'])} tok/s[/bold]"
                if s["decode_ms"]
                else ""
            )
            + f" · finish: {s['finish_reason']}"
            + "  [dim](the tracer's own work is left out of these times)[/dim]"
        )
        c.print(prefill_vs_decode(prefill_tokens, pre_rate, s), style="dim")
        if s.get("verify_steps"):
            c.print(
                f"speculative decoding: {s['verify_steps']} verification step(s) emitted "
                f"{s['verify_tokens']} token(s), {s['verify_tokens'] / s['verify_steps']:.2f} "
                "per step; each reads the weights once for its 1 + k rows",
                style="dim",
            )
        text = Text(trace.prompt["text"], style="dim")
        text.append(s["text"].rstrip(), style="bold green")
        c.print(Panel(text, title="prompt + generated text", title_align="left"))

    # -- sections ---------------------------------------------------------
    def _intro(self, trace) -> None:
        m = trace.model
        self.tokens = list(trace.prompt["texts"])
        self.console.rule(Text(f"tokenmill inspect · {m['name']}", style="bold"))
        self.console.print(
            f"{m['arch']} · {m['num_layers']} layers · d_model {m['hidden_size']} · "
            f"{m['num_heads']} query heads / {m['num_kv_heads']} K/V heads of {m['head_dim']} dims · "
            f"MLP {m['intermediate_size']} ({m['mlp']}, {m['activation']}) · vocab {m['vocab_size']:,} · "
            f"{m['dtype']} · weights {m.get('weights', '?')} · kernels {m.get('kernels', '?')}"
            f" · prefill {m.get('prefill', '?')}"
        )
        if "decode_path" in m:
            self.console.print(
                Text(
                    f"untraced decode steps run the {m['decode_path']} path "
                    f"({m['decode_path_reason']}); this traced request runs the torch path, "
                    "which records every op (models/paths.py)",
                    style="dim",
                )
            )
        if m.get("parallel"):
            self.console.print(
                Text(
                    "parallel run: " + "; ".join(m["parallel"]) + " (the attention and "
                    "residual views show what rank 0 computed)",
                    style="dim",
                )
            )
        if self.seed == DEFAULT_SEED:
            seed = f"seed {self.seed}, the default: a rerun draws the same tokens (--seed N for others)"
        else:
            seed = f"seed {self.seed}" if self.seed is not None else "no seed: each run draws anew"
        self.console.print(Text(seed, style="dim"))

    def _prefill(self, trace, step: StepRecord) -> None:
        c, m = self.console, trace.model
        n, start = step["num_tokens"], step["start"]
        c.rule(f"[bold magenta]Phase 1 · prefill: {n} prompt tokens at once")
        self._section("1. Tokenize", "the text is cut into vocabulary pieces; each piece has an id")
        texts = self.tokens[start : start + n]
        c.print(token_chips(texts, step["input_ids"]))
        c.print(Text("pieces: ", style="dim") + Text(" ".join(step["input_pieces"])))
        self._embedding(step, m)
        self._positions(step)
        self._layers(trace, step, m)
        if "sample" in step:
            self._unembed_and_sample(trace, step, m)
        self._cache_line(step, m)

    def _section(self, title: str, why: str) -> None:
        self.console.print(Text(title, style="bold yellow") + Text(f"  {why}", style="dim"))

    def _embedding(self, step: StepRecord, m: ModelRecord) -> None:
        e = step["embedding"]
        self._section(
            "2. Embed",
            f"each id picks one row of embed.weight [{m['vocab_size']:,}, {m['hidden_size']}] "
            f"→ x {e['shape']}",
        )
        table = Table(box=None, padding=(0, 1), show_edge=False)
        table.add_column("pos", justify="right", style="dim")
        table.add_column("token")
        table.add_column(f"x[:{len(e['sample'][0])}]")
        table.add_column("‖x‖", justify="right")
        for i in table_rows(len(e["sample"])):
            if i is None:
                table.add_row("⋮", "", "", "")
                continue
            pos = step["positions"][i]
            table.add_row(
                str(pos),
                Text(visible(self.tokens[pos])),
                " ".join(f"{v:+.3f}" for v in e["sample"][i]) + " …",
                f"{e['norms'][i]:.2f}",
            )
        print_table(self.console, table)

    def _positions(self, step: StepRecord) -> None:
        pe = step["position_encoding"]
        pos = step["positions"]
        if pe["kind"] == "learned":
            self._section("3. Positions", "a learned vector per position is added to x")
            for i in table_rows(len(pe["sample"])):
                if i is None:
                    self.console.print("  ⋮")
                    continue
                numbers = " ".join(f"{v:+.3f}" for v in pe["sample"][i])
                self.console.print(Text(f"  pos {pos[i]:>3}: + [{numbers} …]"))
            return
        self._section(
            "3. Positions (RoPE)",
            f"positions {pos[0]}..{pos[-1]}; inside attention, each pair of q/k dims is rotated "
            f"by angle pos·θᵢ, so q·k depends on the distance between tokens",
        )
        pairs = min(3, len(pe["inv_freq"]))
        table = Table(box=None, padding=(0, 1), show_edge=False)
        table.add_column("pos", justify="right")
        for i in range(pairs):
            table.add_column(
                f"pair {i} θ={pe['inv_freq'][i]:.3f}: angle (cos, sin)", justify="right"
            )
        for r in table_rows(len(pe["angles"])):
            if r is None:
                table.add_row("⋮", *[""] * pairs)
                continue
            angles, cos, sin = pe["angles"][r], pe["cos"][r], pe["sin"][r]
            table.add_row(
                str(pos[r]),
                *(f"{angles[i]:5.2f} ({cos[i]:+.2f}, {sin[i]:+.2f})" for i in range(pairs)),
            )
        print_table(self.console, table)

    def _layers(self, trace, step: StepRecord, m: ModelRecord) -> None:
        c = self.console
        n = step["num_tokens"]
        group = m["num_heads"] // m["num_kv_heads"]
        first = step["layers"][0]
        self._section(
            f"4. One matrix [{n}, {m['hidden_size']}] through {m['num_layers']} layers",
            "every prompt token in parallel; per layer: x + attention(norm(x)), then x + MLP(norm(x))",
        )
        c.print(
            Text(
                f"   Q = x·W_q → {first['q']} (tokens, heads, head dim)   "
                f"K = x·W_k → {first['k']}   V = x·W_v → {first['v']}"
                + (f"   (GQA: {group} query heads share each K/V head)" if group > 1 else "")
            )
        )
        per_token = m["kv_bytes_per_token"]
        element = per_token // (2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"])
        self._section(
            "5. KV cache write",
            f"each layer stores K and V of the {n} new tokens: {m['num_layers']} layers × 2 × "
            f"{m['num_kv_heads']} heads × {m['head_dim']} dims × {element} bytes = "
            f"{format_bytes(per_token)} per token → {format_bytes(step['kv']['bytes'])} for "
            f"{step['kv']['tokens']} tokens; later steps read them back instead of recomputing",
        )
        self._heatmap(trace, step)
        self._section(
            "7. MLP (the feed-forward network)",
            f"per token: gate, up [{m['hidden_size']}→{m['intermediate_size']}], "
            f"{m['activation']}(gate)·up, down [{m['intermediate_size']}→{m['hidden_size']}]; "
            "below, per layer: how much attention and the MLP each add to the residual stream x "
            "(Δ = norm of the update), and each head's peak weight and entropy (bright = high)",
        )
        table = Table(box=None, padding=(0, 1), show_edge=False)
        table.add_column("layer", justify="right")
        table.add_column("peak weight/head", no_wrap=True)
        table.add_column("entropy/head", no_wrap=True)
        table.add_column("attn Δ", justify="right")
        table.add_column("MLP Δ", justify="right")
        table.add_column("‖x‖", justify="right")
        top_entropy = max(max(layer["entropy"]) for layer in step["layers"]) or 1.0
        for layer in step["layers"]:
            table.add_row(
                str(layer["layer"]),
                head_cells(layer["max"]),
                head_cells([e / top_entropy for e in layer["entropy"]]),
                f"{layer['attention_update_norm']:.1f}",
                f"{layer['mlp_update_norm']:.1f}",
                f"{layer['mlp_residual_norm']:.1f}",
            )
        print_table(c, table)

    def _heatmap(self, trace, step: StepRecord) -> None:
        att = _map(step)
        if att is None:
            return
        head = att["heads"][0]
        self._section(
            f"6. Masked multi-head attention · layer {att['layer']} head {head}",
            "softmax(Q·Kᵀ/√d) row by row; a token may only look at itself and earlier tokens (· = masked)",
        )
        print_table(self.console, heatmap(att, self.tokens))
        if att["context"] > HEATMAP_MAX_TOKENS:
            self.console.print(
                f"   (the newest {HEATMAP_MAX_TOKENS} of {att['context']} tokens)", style="dim"
            )
        legend = Text("   weight 0 ")
        for w in (0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1):
            legend.append_text(heat_cell(w))
        legend.append(f" 1   (square-root scale; shades '{SHADES}' from 0 to 1)")
        self.console.print(legend, style="dim")

    def _unembed_and_sample(self, trace, step: StepRecord, m: ModelRecord) -> None:
        s = step["sample"]
        p = s["params"]
        weight = "embed.weight" if m["tie_embeddings"] else "lm_head.weight"
        self._section(
            "8. Un-embed",
            f"final norm, then the last token's row [{m['hidden_size']}] · {weight}ᵀ "
            f"[{m['hidden_size']}, {s['vocab']:,}] → logits [{s['vocab']:,}]: one score per vocabulary entry",
        )
        self._section(
            f"9. Softmax (entropy {s['entropy']:.2f} bits) · temperature {p['temperature']:g} "
            f"(entropy {s['entropy_after_temperature']:.2f} bits)",
            "p = softmax(logits / T); T < 1 sharpens, T > 1 flattens",
        )
        grammar = s.get("grammar")
        if grammar is not None:
            masked = len(grammar["masked"])
            self._section(
                f"9b. Grammar mask ({grammar['kind']}): {grammar['allowed']:,} of "
                f"{grammar['vocab']:,} vocabulary entries allowed",
                f"the rest get logit -inf before temperature; {masked} of the top candidates "
                f"masked out, {grammar['masked_mass']:.1%} of the model's probability",
            )
        cut = s["survivors"]
        self._section(
            f"10. Filters: top-k {p['top_k'] or 'off'} → {cut['top_k']:,} left · "
            f"top-p {p['top_p']:g} → {cut['top_p']:,} left · min-p {p['min_p']:g} → {cut['min_p']:,} left",
            "the survivors are renormalised to sum to 1 and one is drawn",
        )
        print_table(self.console, self._candidates(s))
        self._chosen(s)

    def _candidates(self, s: dict[str, Any]) -> Table:
        table = Table(box=None, padding=(0, 1), show_edge=False)
        table.add_column("token")
        table.add_column("id", justify="right", style="dim")
        table.add_column("logit", justify="right")
        table.add_column("p (T=1)", justify="right")
        table.add_column("p after T", justify="right")
        table.add_column("final p after cuts", no_wrap=True)
        for cand in s["candidates"]:
            chosen = cand["id"] == s["token"]
            style = "bold green" if chosen else ("" if cand["kept"] else "dim strike")
            final = Text(f"{cand['final_prob']:6.1%} ") + bar(
                cand["final_prob"], style="green" if chosen else "blue"
            )
            table.add_row(
                Text(("▶ " if chosen else "  ") + visible(cand["text"]), style=style),
                str(cand["id"]),
                f"{cand['logit']:.2f}",
                f"{cand['prob']:.1%}",
                f"{cand['scaled_prob']:.1%}",
                final if cand["kept"] else _cut_label(cand),
            )
        return table

    def _chosen(self, s: dict[str, Any]) -> None:
        how = "argmax (greedy)" if s["params"]["greedy"] else "drawn at random from the survivors"
        self._section(
            f"11. Sample: {visible(s['token_text'])!r} (id {s['token']}) with p = {s['prob']:.1%}",
            f"{how}; rank {s['rank']} by logit",
        )
        shown = (
            "(a stop token: generation ends, nothing is shown)" if s["is_stop"] else repr(s["text"])
        )
        self._section(f"12. Detokenize: piece {s['piece']!r} → text {shown}", "")

    def _cache_line(self, step: StepRecord, m: ModelRecord) -> None:
        kv = step["kv"]
        gauge = bar(kv["pool_blocks_used"] / kv["pool_blocks_total"], width=16, style="yellow")
        fed = ""
        if "sample" in step and not kv["released"]:
            fed = (
                f"; token {step['sample']['token']} is appended and fed back as the next input "
                f"at position {kv['tokens']}"
            )
        self.console.print(
            Text("13. KV cache ", style="bold yellow")
            + Text(
                f"{kv['tokens']} tokens · {format_bytes(kv['bytes'])} · {kv['blocks']} block(s) · pool "
            )
            + gauge
            + Text(
                f" {kv['pool_blocks_used']}/{kv['pool_blocks_total']} blocks used{fed}", style="dim"
            )
        )
        for sample in step.get("samples", [step["sample"]] if "sample" in step else []):
            self.tokens.append(sample["token_text"])

    def _decode_header(self) -> Console:
        """The decode loop's rule, once, before its first step (plain or verification)."""
        if not self.decode_header_shown:
            self.console.rule(
                "[bold cyan]Phase 2 · decode loop: one token per step, reading the KV cache"
            )
            self.decode_header_shown = True
        return self.console

    def _verify(self, trace, step: StepRecord) -> None:
        """A verification step: the last token and k guesses as 1 + k rows in one pass;
        each row's token is drawn as a plain decode would draw it, kept while it equals
        the guess (engine/speculative.py), and the rejected rows' K/V go back."""
        c = self._decode_header()  # a verification can be the first step after the prompt
        sp, kv, samples = step["speculation"], step["kv"], step["samples"]
        pos = step["positions"][0]
        head = Text(f"step {step['index']} · verify", style="bold cyan")
        head.append(
            f"  input {visible(self.tokens[pos])!r} at position {pos} + {len(sp['proposed'])} "
            f"{sp['method']} guess(es) as {step['num_tokens']} rows in one pass  ·  "
            f"{step['step_ms']:.1f} ms"
        )
        if sp["plain_step_ms"]:
            head.append(
                f" (a plain decode step: {sp['plain_step_ms']:.1f} ms, x{sp['step_vs_plain']:.2f})"
            )
        lines: list[Any] = [head]
        for j, guess in enumerate(sp["proposed_texts"]):
            row = samples[j] if j < len(samples) else None
            if row is None:
                mark, why = (
                    Text("  · ", style="dim"),
                    "not reached (a rejection or a stop came first)",
                )
            elif row["guess_accepted"]:
                mark, why = Text("  ✓ ", style="bold green"), f"target p {row['guess_prob']:.1%}"
            else:
                mark = Text("  ✗ ", style="bold red")
                why = (
                    f"target p {row['guess_prob']:.1%}; it chose {visible(row['token_text'])!r} "
                    f"(p {row['prob']:.1%}) instead"
                )
            lines.append(
                mark + Text(f"guess {j + 1} {visible(guess)!r:<14}") + Text(why, style="dim")
            )
        if len(samples) > len(sp["proposed"]):  # every guess held: the row after the last
            own = samples[-1]
            lines.append(
                Text("  + ", style="bold green")
                + Text(f"and the target's own next token {visible(own['token_text'])!r}")
                + Text(f" (p {own['prob']:.1%})", style="dim")
            )
        text = "".join(s["text"] for s in samples)
        lines.append(
            Text(
                f"  accepted {sp['accepted']} of {len(sp['proposed'])} → {sp['emitted']} token(s) "
                f"{text!r} appended; {sp['rolled_back']} rejected row(s) of K/V rolled back, "
                f"cache {kv['tokens']} tokens, {format_bytes(kv['bytes'])}",
                style="dim",
            )
        )
        c.print(Group(*lines))
        for sample in samples:
            self.tokens.append(sample["token_text"])

    def _decode(self, trace, step: StepRecord) -> None:
        c = self._decode_header()
        s, kv = step["sample"], step["kv"]
        pos = step["positions"][0]
        head = Text(f"step {step['index']}", style="bold cyan")
        head.append(
            f"  input {visible(self.tokens[pos])!r} (id {step['input_ids'][0]}) at position {pos}"
            f" → Q {step['layers'][0]['q']}, K/V for it written: cache {kv['tokens']} tokens, "
            f"{format_bytes(kv['bytes'])}  ·  {step['step_ms']:.1f} ms"
        )
        lines: list[Any] = [head]
        att = _map(step)
        if att is not None:
            lines.append(
                Text(f"  attention L{att['layer']} H{att['heads'][0]} over {att['context']} keys ")
                + attention_strip(att)
            )
        cut = s["survivors"]
        grammar = s.get("grammar")
        allows = f"grammar allows {grammar['allowed']:,} → " if grammar is not None else ""
        lines.append(
            Text(
                f"  logits [{s['vocab']:,}] → {allows}softmax T={s['params']['temperature']:g} → "
                f"top-p {s['params']['top_p']:g} keeps {cut['top_p']:,} → sample",
                style="dim",
            )
        )
        for cand in s["candidates"][:5]:
            chosen = cand["id"] == s["token"]
            line = Text(
                ("  ▶ " if chosen else "    ") + f"{visible(cand['text'])!r:<14}",
                style="bold green" if chosen else "",
            )
            if cand["kept"]:
                line.append(f"{cand['final_prob']:6.1%} ")
                line.append(bar(cand["final_prob"], style="green" if chosen else "blue"))
            else:
                line.append_text(Text("   ") + _cut_label(cand))
            lines.append(line)
        appended = (
            "stop token: done" if s["is_stop"] else f"detokenized {s['text']!r}, appended, fed back"
        )
        lines.append(Text(f"  chose id {s['token']} (p {s['prob']:.1%}) → {appended}", style="dim"))
        c.print(Group(*lines))
        self.tokens.append(s["token_text"])
