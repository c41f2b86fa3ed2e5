"""`specdec bench --suite llama-cpp`: specdec against llama.cpp on the same GGUF files and the same threads.

llama.cpp is what a CPU user would run instead (ollama is llama.cpp too). It comes from PyPI as llama-cpp-python
(an sdist built with the machine's cmake: `pip install 'specdec[peers]'`, then cached by pip), used in this
process: plain greedy decoding, and its prompt-lookup drafting (`LlamaPromptLookupDecoding`), both with
`use_mmap=False` (weights repacked for its CPU kernels at load: its fastest setting here).

Measured, in one run:
1. cost curves: ms per forward pass over k new tokens (logits for every row) at a 160-token context, for the
   target and the draft, on specdec's gguf engine and on llama.cpp;
2. end to end, interleaved per prompt and repeat (repeat 0 is a warm-up, not counted): the code and input-grounded
   prompts, greedy, `max_new_tokens` tokens, through specdec's services (target-only and auto gamma with the
   target's default draft, with prompt lookup and with the model draft) and through llama.cpp: in this process
   plain and with prompt lookup, and llama-server (bench.llama_server) plain and with the draft model (`-md`).
   Every specdec output is checked against specdec's own target-only output. Suffix trees run without their
   global tree (measured_draft): every prompt runs once per repeat, and the shared tree would copy the answer it
   gave the same prompt before;
3. CONCURRENT_CLIENTS clients at once, the default deployment against llama-server with as many parallel slots
   (`-np`): aggregate tokens/s, waves interleaved.
"""

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.bench.llama_server import LlamaServer
from specdec.bench.runner import grpc_run, load_prompts, machine_description, rotated, run_to_dict
from specdec.common.model_specs import base_model, gguf_path
from specdec.common.models import load_model
from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import MODEL_FREE_DRAFT_IN_COORDINATOR, Cluster, default_draft_for, free_port, model_draft_for
from specdec.draft_worker.specs import is_model_free

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
CATEGORIES = ("code", "input-grounded")
QUICK_PROMPTS = ["palindrome", "fix-typos"]
CURVE_TOKENS = (1, 2, 3, 4, 5, 8)
CURVE_CONTEXT = 160
CONCURRENT_CLIENTS = 8
PEER_PREFIXES = ("llama.cpp", "llama-server")  # the systems that are llama.cpp's configurations
LOOKUP_TOKENS = 10  # LlamaPromptLookupDecoding's default num_pred_tokens


@dataclass
class LlamaCppConfig:
    name: str
    target_model: str = DEFAULT_TARGET
    draft_model: str | None = None  # default: the target's default draft
    threads: int = 2
    device: str = "cpu"
    quick: bool = False
    max_new_tokens: int = 128
    repeats: int = 2
    output_root: str = "bench/results"

    def __post_init__(self):
        self.draft_model = self.draft_model or default_draft_for(self.target_model)
        if self.quick:
            self.max_new_tokens, self.repeats = min(self.max_new_tokens, 48), 1


def llama(path: str, threads: int, lookup: bool = False, logits_all: bool = False):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if lookup else None
    return Llama(
        model_path=path,
        n_ctx=4096,
        n_threads=threads,
        n_threads_batch=threads,
        use_mmap=False,
        logits_all=logits_all,
        draft_model=draft,
        verbose=False,
    )


def curve_prompt() -> str:
    return 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 12


def llama_passes(path: str, threads: int):
    """llama.cpp's pass over k new tokens on a CURVE_CONTEXT-token context (then rolled back), and its prefill of
    that context (logits for the last row only, as a request's prefill)."""
    scorer, prefiller = llama(path, threads, logits_all=True), llama(path, threads)
    tokens = scorer.tokenize(curve_prompt().encode())[:CURVE_CONTEXT]
    scorer.eval(tokens)
    base = scorer.n_tokens

    def step(k: int) -> None:
        scorer.n_tokens = base  # eval() removes the cache past n_tokens first: a rollback
        scorer.eval(tokens[10 : 10 + k])

    def prefill() -> None:
        prefiller.reset()
        prefiller.eval(tokens)

    return step, prefill


def gguf_passes(spec: str):
    """The same two passes on the gguf engine."""
    loaded = load_model(spec, engine="gguf")
    runner = loaded.runner
    tokens = loaded.tokenizer.encode(curve_prompt())[:CURVE_CONTEXT]
    cache = runner.new_cache()
    runner.forward([cache], [tokens], [1])
    base = cache.get_seq_length()

    def step(k: int) -> None:
        runner.forward([cache], [tokens[10 : 10 + k]], [k])
        runner.crop_to(cache, base)

    def prefill() -> None:
        runner.forward([runner.new_cache()], [tokens], [1])

    return step, prefill


def interleaved_curves(systems: dict, repeats: int = 5) -> dict[str, dict]:
    """{name: (step, prefill)} -> {name: {k: median ms, "prefill": median ms per token}}: every measurement of one
    shape taken in turn across the systems, so that the machine's drift (25-30 % within minutes on this VM) falls
    on all of them alike."""
    times = {name: {k: [] for k in (*CURVE_TOKENS, "prefill")} for name in systems}
    for k in (*CURVE_TOKENS, "prefill"):
        for _ in range(repeats + 1):  # the first of each shape warms up
            for name, (step, prefill) in systems.items():
                started = time.perf_counter()
                if k == "prefill":
                    prefill()
                else:
                    step(k)
                times[name][k].append((time.perf_counter() - started) * 1000)
    return {
        name: {k: statistics.median(t[1:]) / (CURVE_CONTEXT if k == "prefill" else 1) for k, t in shapes.items()}
        for name, shapes in times.items()
    }


def llama_run(llm, prompt: dict, max_new_tokens: int) -> dict:
    """One greedy request to llama.cpp: llama-cpp-python's Llama in this process, or a LlamaServer (same call)."""
    start = time.perf_counter()
    response = llm.create_chat_completion(
        messages=[{"role": "user", "content": prompt["prompt"]}], max_tokens=max_new_tokens, temperature=0.0
    )
    seconds = time.perf_counter() - start
    return {
        "tokens": response["usage"]["completion_tokens"],
        "seconds": seconds,
        "text": response["choices"][0]["message"]["content"],
    }


def specdec_run(client: GenerationClient, prompt: dict, max_new_tokens: int, gamma: int) -> dict:
    """One greedy request through the coordinator (bench.runner.grpc_run), as a row."""
    return run_to_dict(grpc_run(client, "specdec", prompt, gamma, 0.0, 0, max_new_tokens))


def run_cluster_systems(
    config: LlamaCppConfig, draft: str, prompts: list[dict], peers: dict, out: Path, parallel_peer: LlamaServer | None = None
) -> tuple[list[dict], list[dict]]:
    """One cluster (target + `draft`), its systems interleaved with the peers' ({name: prompt -> row}) per prompt
    and repeat; then, given parallel_peer, CONCURRENT_CLIENTS clients at once on the cluster and on that peer in
    turn. Returns the single-client rows and the concurrent ones."""
    logs = out / ("logs-" + "".join(c if c.isalnum() or c in "-." else "_" for c in draft))
    logs.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(
        target_model=config.target_model,
        draft_model=draft,
        port=free_port(),
        extra_worker_args=["--threads", str(config.threads)],
        log_dir=logs,
        local_draft=MODEL_FREE_DRAFT_IN_COORDINATOR,  # as the default deployment runs a model-free draft
        # Target-only and auto take turns on each prompt: with a prefix cache the second would find it cached (the
        # peers meet each prompt once per repeat and share only the chat template's opening with the last one).
        prefix_cache=False,
    )
    cluster.start()
    rows, concurrent = [], []
    try:
        with GenerationClient(cluster.address) as client:
            for repeat in range(config.repeats + 1):
                for index, prompt in enumerate(prompts):
                    systems = {"specdec target-only": lambda p: specdec_run(client, p, config.max_new_tokens, 0)}
                    systems[f"specdec auto ({draft})"] = lambda p: specdec_run(client, p, config.max_new_tokens, -1)
                    systems.update(peers)
                    for system, run in rotated(list(systems.items()), repeat * len(prompts) + index):
                        row = run(prompt)
                        row.update(system=system, prompt=prompt["id"], category=prompt["category"], repeat=repeat)
                        rows.append(row)
                        print(f"{system:36s} {prompt['id']:14s} {row['tokens'] / row['seconds']:6.2f} tok/s", flush=True)
            if parallel_peer is not None:
                systems = {
                    f"specdec auto ({draft})": lambda p: specdec_run(client, p, config.max_new_tokens, -1),
                    f"llama-server -np {CONCURRENT_CLIENTS}": lambda p: llama_run(parallel_peer, p, config.max_new_tokens),
                }
                concurrent = concurrent_rows(systems, prompts, config.repeats)
    finally:
        cluster.stop()
    return rows, concurrent


def concurrent_rows(systems: dict, prompts: list[dict], repeats: int) -> list[dict]:
    """CONCURRENT_CLIENTS clients at once, each sending one request (the prompts in turn), per system in turn and
    repeat (repeat 0 warms up): the wall time of the whole wave and the tokens it produced."""
    wave = [prompts[i % len(prompts)] for i in range(CONCURRENT_CLIENTS)]
    rows = []
    with ThreadPoolExecutor(CONCURRENT_CLIENTS) as pool:
        for repeat in range(repeats + 1):
            for system, run in systems.items():
                start = time.perf_counter()
                done = list(pool.map(run, wave))
                seconds = time.perf_counter() - start
                tokens = sum(r["tokens"] for r in done)
                rows.append({"system": system, "repeat": repeat, "tokens": tokens, "seconds": seconds})
                print(f"{CONCURRENT_CLIENTS} clients: {system:36s} {tokens / seconds:6.2f} tok/s in all", flush=True)
    return rows


def summarise(rows: list[dict]) -> dict:
    counted = [r for r in rows if r["repeat"] > 0] or rows
    table = {}
    for category in CATEGORIES:
        for system in dict.fromkeys(r["system"] for r in counted):
            rates = [r["tokens"] / r["seconds"] for r in counted if r["system"] == system and r["category"] == category]
            if rates:
                table.setdefault(category, {})[system] = statistics.median(rates)
    return table


def identical_to_target_only(rows: list[dict]) -> dict[str, bool]:
    """Per specdec system: whether every output equals specdec target-only's for the same prompt."""
    reference = {r["prompt"]: r["token_ids"] for r in rows if r["system"] == "specdec target-only"}
    return {
        system: all(r["token_ids"] == reference[r["prompt"]] for r in rows if r["system"] == system)
        for system in dict.fromkeys(r["system"] for r in rows if r["system"].startswith("specdec"))
    }


def summarise_concurrent(rows: list[dict]) -> dict:
    """{system: median aggregate tokens/s} over the counted waves."""
    counted = [r for r in rows if r["repeat"] > 0] or rows
    systems = dict.fromkeys(r["system"] for r in counted)
    return {s: statistics.median(r["tokens"] / r["seconds"] for r in counted if r["system"] == s) for s in systems}


def report(config: LlamaCppConfig, curves: dict, table: dict, identical: dict, machine: dict, concurrent: dict) -> str:
    lines = [f"# specdec against llama.cpp: {config.name}", "", ", ".join(f"{k}: {v}" for k, v in machine.items()), ""]
    lines += [
        f"## Cost curves (ms per pass over k new tokens on a {CURVE_CONTEXT}-token context, logits for every row; "
        f"prefill: ms per token of that context; each shape measured in turn across the two systems)",
        "",
    ]
    header = " | ".join(f"k={k}" for k in CURVE_TOKENS)
    lines += [f"| | {header} | k=4 / k=1 | prefill |", "|---" * (len(CURVE_TOKENS) + 3) + "|"]
    for name, curve in curves.items():
        values = " | ".join(f"{curve[k]:.1f}" for k in CURVE_TOKENS)
        lines.append(f"| {name} | {values} | {curve[4] / curve[1]:.2f} | {curve['prefill']:.1f} |")
    lines += ["", f"## End to end: greedy, {config.max_new_tokens} tokens, {config.threads} threads, median tokens/s", ""]
    for category, systems in table.items():
        best_peer = max(v for k, v in systems.items() if k.startswith(PEER_PREFIXES))
        lines += [f"### {category}", "", "| system | tokens/s | x best llama.cpp |", "|---|---|---|"]
        lines += [f"| {name} | {rate:.2f} | {rate / best_peer:.2f} |" for name, rate in systems.items()]
        lines.append("")
    lines += ["Greedy output identical to specdec target-only: " + ", ".join(f"{k}: {v}" for k, v in identical.items()), ""]
    if concurrent:
        peer = next(v for k, v in concurrent.items() if k.startswith("llama-server"))
        lines += [
            f"## {CONCURRENT_CLIENTS} concurrent clients: aggregate tokens/s (one request each, the prompts in turn)",
            "",
            "| system | tokens/s | x llama-server |",
            "|---|---|---|",
        ]
        lines += [f"| {name} | {rate:.2f} | {rate / peer:.2f} |" for name, rate in concurrent.items()]
        lines.append("")
    return "\n".join(lines)


def measured_draft(draft: str) -> str:
    """The draft as the suite runs it: suffix trees without their global tree (`global=0`), which would hold the
    warm-up's and earlier repeats' answers to the very prompts measured, and copy them."""
    if draft.split(":")[0] == "suffix" and "global=" not in draft:
        return f"{draft}{',' if ':' in draft else ':'}global=0"
    return draft


def run_llama_cpp(config: LlamaCppConfig) -> Path:
    out = Path(config.output_root) / config.name
    out.mkdir(parents=True, exist_ok=True)
    target_file = gguf_path(config.target_model)
    drafts = (config.draft_model, model_draft_for(config.target_model))
    model_draft = next((d for d in drafts if d and not is_model_free(d)), None)
    draft_base = base_model(model_draft) if model_draft else None
    models = [config.target_model] + ([draft_base] if draft_base and gguf_path(draft_base) else [])
    curves = {}
    for model in models:
        curves |= interleaved_curves(
            {
                f"specdec gguf engine, {model}": gguf_passes(model),
                f"llama.cpp, {model}": llama_passes(gguf_path(model), config.threads),
            }
        )
    for name, curve in curves.items():
        print(f"{name}: " + "  ".join(f"k={k} {ms:.1f}" for k, ms in curve.items()), flush=True)
    prompts = [p for p in load_prompts(QUICK_PROMPTS if config.quick else None) if p["category"] in CATEGORIES]
    draft_file = gguf_path(draft_base) if draft_base else None
    with ExitStack() as servers:
        serve = lambda name, **kw: servers.enter_context(  # noqa: E731
            LlamaServer(target_file, config.threads, log=out / f"{name}.log", **kw)
        )
        single, parallel = serve("llama-server"), serve("llama-server-np", slots=CONCURRENT_CLIENTS)
        llms = {
            "llama.cpp": llama(target_file, config.threads),
            "llama.cpp prompt lookup": llama(target_file, config.threads, lookup=True),
        }
        peers = {name: lambda p, llm=llm: llama_run(llm, p, config.max_new_tokens) for name, llm in llms.items()}
        peers["llama-server"] = lambda p: llama_run(single, p, config.max_new_tokens)
        if draft_file:
            with_draft = serve("llama-server-md", draft=draft_file)
            peers[f"llama-server -md {draft_base}"] = lambda p: llama_run(with_draft, p, config.max_new_tokens)
        rows, concurrent = [], []
        for draft in dict.fromkeys(measured_draft(d) for d in (config.draft_model, "ngram", model_draft) if d):
            first = not rows
            single_rows, concurrent_part = run_cluster_systems(
                config, draft, prompts, peers if first else {}, out, parallel if first else None
            )
            rows += single_rows
            concurrent += concurrent_part
    table, identical, machine = summarise(rows), identical_to_target_only(rows), machine_description()
    table_concurrent = summarise_concurrent(concurrent)
    results = {
        "config": asdict(config),
        "machine": machine,
        "curves": curves,
        "rows": rows,
        "table": table,
        "concurrent_rows": concurrent,
        "concurrent": table_concurrent,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(config, curves, table, identical, machine, table_concurrent))
    return out
