"""Real clients, unmodified, against specdec serving the Qwen pair (qwen2.5-coder-1.5b verified by its 0.5B
sibling, the processes `specdec up --target-model qwen2.5-coder-1.5b` runs): the official openai SDK, instructor,
langchain-openai and lm-evaluation-harness's local-completions. Each run shows that speculation stayed on (the
coordinator's drafted-tokens counter grew, where drafting applies) and that the client gets exactly what it gets
with `num_speculative_tokens: 0`. Results of a run: docs/openai-clients.md.

Slow tier (the 1.5B pair on a CPU); a client whose package is missing is skipped (`pip install -e '.[clients]'`).
SPECDEC_CLIENTS_URL (the API's base URL) and SPECDEC_CLIENTS_METRICS (the coordinator's /metrics URL) point the
tests at a service that is already running instead of starting one."""

import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow  # loads the 1.5B pair and generates with it (minutes on 2 cores)

MODEL = "qwen2.5-coder-1.5b"
OFF = {"num_speculative_tokens": 0}
# Speculation on at a fixed gamma: auto lets the cost model price drafting out on a machine whose speeds say so,
# and a test that proves equality must see drafted tokens on any machine.
ON = {"num_speculative_tokens": 4}
DRAFTED = re.compile(r"^specdec_speculation_drafted_tokens_total(\{[^}]*\})? (\S+)$", re.MULTILINE)


class Service:
    def __init__(self, url: str, metrics: str):
        self.url, self.metrics = url, metrics

    def drafted(self) -> float:
        """The coordinator's drafted tokens so far (all requests)."""
        with urllib.request.urlopen(self.metrics, timeout=10) as response:
            text = response.read().decode()
        return sum(float(value) for _, value in DRAFTED.findall(text))

    def openai(self, **options):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=600, **options)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    if os.environ.get("SPECDEC_CLIENTS_URL"):
        yield Service(os.environ["SPECDEC_CLIENTS_URL"], os.environ["SPECDEC_CLIENTS_METRICS"])
        return
    from specdec.coordinator.cluster import MODEL_FREE_DRAFT_IN_COORDINATOR, Cluster, free_port

    http, metrics = free_port(), free_port()
    with Cluster(
        MODEL,
        None,
        free_port(),
        http_port=http,
        local_draft=MODEL_FREE_DRAFT_IN_COORDINATOR,  # as specdec up
        extra_coordinator_args=["--metrics-port", str(metrics)],
        log_dir=tmp_path_factory.mktemp("clients"),
    ):
        yield Service(f"http://127.0.0.1:{http}/v1", f"http://127.0.0.1:{metrics}/metrics")


def speculated_and_alone(service: Service, run, label: str = ""):
    """run(extra_body) twice: with speculation at gamma 4 (the drafted-tokens counter must grow) and with it off (it must not)."""
    before = service.drafted()
    speculated = run(dict(ON))
    middle = service.drafted()
    alone = run(dict(OFF))
    drafted, drafted_alone = middle - before, service.drafted() - middle
    print(f"{label}: drafted tokens {drafted:.0f} with speculation, {drafted_alone:.0f} without")
    assert drafted > 0, "speculation did not stay on"
    assert drafted_alone == 0, "num_speculative_tokens 0 did not reach the service"
    return speculated, alone, drafted


class Weather(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city for some days",
        "parameters": Weather.model_json_schema(),
    },
}
ASK_WEATHER = [{"role": "user", "content": "What will the weather be in Oslo for the next 3 days?"}]


def test_the_official_sdk(service):
    client = service.openai()

    def chat(extra, **options):
        return client.chat.completions.create(model=MODEL, temperature=0, extra_body=extra, **options)

    # logprobs, on an edit whose answer quotes the prompt: prompt lookup then has something to draft on whatever
    # CPU (and so whatever rounding) the answer comes from
    code = "def total(items):\n    result = 0\n    for item in items:\n        result = result + item\n    return result"
    edit = f"Rename the variable result to acc in this Python function and reply with the code only:\n\n{code}"
    messages = [{"role": "user", "content": edit}]
    spec, off, _ = speculated_and_alone(
        service, lambda x: chat(x, messages=messages, max_tokens=32, logprobs=True, top_logprobs=3), "sdk logprobs"
    )
    assert spec.choices[0].message.content == off.choices[0].message.content
    ours, theirs = spec.choices[0].logprobs.content, off.choices[0].logprobs.content
    assert [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in ours] == [
        (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in theirs
    ]  # bit for bit (the gguf engine)
    # echo: the prompt's own log-probabilities, as an eval harness asks them (no drafting: nothing is generated)
    echo = {"prompt": "def add(a, b):\n    return a + b", "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    scored = [client.completions.create(model=MODEL, extra_body=x, **echo).choices[0].logprobs for x in ({}, OFF)]
    assert scored[0].token_logprobs == scored[1].token_logprobs and scored[0].tokens == scored[1].tokens
    # parse with a Pydantic model
    spec, off, _ = speculated_and_alone(
        service,
        lambda x: client.chat.completions.parse(
            model=MODEL, messages=ASK_WEATHER, response_format=Weather, temperature=0, max_tokens=40, extra_body=x
        ),
        "sdk parse",
    )
    assert isinstance(spec.choices[0].message.parsed, Weather) and spec.choices[0].message.parsed.city == "Oslo"
    assert spec.choices[0].message.content == off.choices[0].message.content
    # json_object
    json_messages = [
        {"role": "system", "content": 'Reply with exactly {"city": <the city>, "days": <the number of days>} and nothing else.'},
        *ASK_WEATHER,
    ]
    spec, off, _ = speculated_and_alone(
        service,
        lambda x: chat(x, messages=json_messages, max_tokens=60, response_format={"type": "json_object"}),
        "sdk json_object",
    )
    assert isinstance(json.loads(spec.choices[0].message.content), dict)
    assert spec.choices[0].message.content == off.choices[0].message.content
    # tools, whole and streamed: a call required (left to choose, tool_choice auto, the 1.5B coder answers with the
    # call in a ```json block rather than in its template's <tool_call> tags)
    tools = {"tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    spec, off, _ = speculated_and_alone(service, lambda x: chat(x, messages=ASK_WEATHER, max_tokens=60, **tools), "sdk tools")
    (call,) = spec.choices[0].message.tool_calls
    assert spec.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert Weather.model_validate_json(call.function.arguments).city == "Oslo"
    assert call.function.arguments == off.choices[0].message.tool_calls[0].function.arguments
    stream = chat(dict(ON), messages=ASK_WEATHER, max_tokens=60, stream=True, **tools)
    deltas = [d for chunk in stream for d in (chunk.choices[0].delta.tool_calls or [])]
    # Streamed in pieces that add up to the whole call (a round may carry many tokens: the suffix trees copy the
    # arguments of the same call answered just before).
    assert deltas[0].function.name == "get_weather" and len(deltas) > 1
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments

    # n: distinct choices with their own seeds, the same again with the same seed; each choice speculates
    def sample(messages, max_tokens):
        return client.chat.completions.create(
            model=MODEL, messages=messages, n=3, seed=5, temperature=1.0, max_tokens=max_tokens, extra_body=ON
        )

    open_question = [{"role": "user", "content": "Write a Python one-liner that reverses a string s."}]
    three, again = sample(open_question, 16), sample(open_question, 16)
    texts = [c.message.content for c in sorted(three.choices, key=lambda c: c.index)]
    # Each choice samples with its own seed (two may still agree on a short, likely answer); the same seed, the same texts.
    assert len(set(texts)) > 1 and texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]
    before = service.drafted()
    edits = sample(messages, 40)
    assert len(edits.choices) == 3 and service.drafted() > before


def test_instructor(service):
    instructor = pytest.importorskip("instructor")

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(service.openai(), mode=mode)

        def run(extra, client=client):
            return client.chat.completions.create_with_completion(
                model=MODEL,
                response_model=Weather,
                messages=ASK_WEATHER,
                temperature=0,
                max_tokens=60,
                max_retries=0,
                extra_body=extra,
            )

        (spec, spec_raw), (off, off_raw), _ = speculated_and_alone(service, run, f"instructor {mode.value}")
        assert isinstance(spec, Weather) and spec.model_dump() == off.model_dump() and spec.city == "Oslo", mode
        said = [
            (r.choices[0].message.content, [c.function for c in r.choices[0].message.tool_calls or []])
            for r in (spec_raw, off_raw)
        ]
        assert said[0] == said[1], mode  # the same text or call, token for token
        assert spec_raw.model_extra["speculation"]["drafted_tokens"] > 0 == off_raw.model_extra["speculation"]["drafted_tokens"]


def test_langchain_openai(service):
    langchain_openai = pytest.importorskip("langchain_openai")

    def llm(extra):
        return langchain_openai.ChatOpenAI(
            model=MODEL, base_url=service.url, api_key="unused", temperature=0, max_tokens=60, max_retries=0, extra_body=extra
        )

    question = "What will the weather be in Oslo for the next 3 days?"
    # bind_tools, invoked and streamed
    spec, off, _ = speculated_and_alone(
        service,
        lambda x: llm(x).bind_tools([Weather], tool_choice="Weather", parallel_tool_calls=False).invoke(question),
        "langchain bind_tools",
    )
    (call,) = spec.tool_calls
    assert call["name"] == "Weather" and Weather.model_validate(call["args"]).city == "Oslo"
    assert [(c["name"], c["args"]) for c in off.tool_calls] == [(call["name"], call["args"])]
    chunks = list(llm(dict(ON)).bind_tools([Weather], tool_choice="Weather", parallel_tool_calls=False).stream(question))
    assert len([c for c in chunks if c.tool_call_chunks]) > 3  # the arguments came in pieces
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]
    # with_structured_output, with each of its methods (json_mode sends no schema: the prompt gives it)
    shape = ' Reply with exactly {"city": <the city>, "days": <the number of days>} and nothing else.'
    for method in ("json_schema", "function_calling", "json_mode"):
        spec, off, _ = speculated_and_alone(
            service,
            lambda x, method=method: llm(x).with_structured_output(Weather, method=method).invoke(question + shape),
            f"langchain with_structured_output {method}",
        )
        assert isinstance(spec, Weather) and spec == off, method


MC_QUESTIONS = [
    ("What does len([1, 2, 3]) return in Python?", ["3", "2", "6", "[1, 2, 3]"], 0),
    ("Which keyword defines a function in Python?", ["func", "def", "lambda", "fn"], 1),
    ("What is the type of 3 / 2 in Python 3?", ["int", "str", "float", "bool"], 2),
    ("Which method adds an item to the end of a Python list?", ["add", "push", "insert", "append"], 3),
    ("What does 'hello'.upper() return?", ["'HELLO'", "'hello'", "'Hello'", "None"], 0),
    ("Which of these is immutable in Python?", ["list", "tuple", "dict", "set"], 1),
    ("What is 2 ** 3 in Python?", ["6", "9", "8", "5"], 2),
    ("Which statement handles exceptions in Python?", ["catch", "except", "rescue", "handle"], 1),
]
GEN_PROMPTS = [
    ("def add(a, b):\n    return", "a + b"),
    ("def is_even(n):\n    return", "n % 2 == 0"),
    ("def square(x):\n    return", "x * x"),
    ("# reverse the string s\ndef reverse(s):\n    return", "s[::-1]"),
]


def write_tasks(folder: Path) -> None:
    """A multiple-choice task and a short code-completion task, from local files (no dataset download)."""
    with open(folder / "mc.jsonl", "w") as out:
        for question, choices, answer in MC_QUESTIONS:
            out.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "gen.jsonl", "w") as out:
        for prompt, answer in GEN_PROMPTS:
            out.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    common = "dataset_path: json\ntest_split: train\n"
    (folder / "specdec_mc.yaml").write_text(
        f"task: specdec_mc\n{common}dataset_kwargs:\n  data_files:\n    train: {folder / 'mc.jsonl'}\n"
        + textwrap.dedent("""\
            output_type: multiple_choice
            doc_to_text: "Question: {{question}}\\nAnswer:"
            doc_to_choice: "{{choices}}"
            doc_to_target: answer
            metric_list:
              - metric: acc
              - metric: acc_norm
            """)
    )
    (folder / "specdec_gen.yaml").write_text(
        f"task: specdec_gen\n{common}dataset_kwargs:\n  data_files:\n    train: {folder / 'gen.jsonl'}\n"
        + textwrap.dedent("""\
            output_type: generate_until
            doc_to_text: "{{prompt}}"
            doc_to_target: " {{answer}}"
            generation_kwargs:
              until: ["\\n"]
              max_gen_toks: 24
              temperature: 0
            metric_list:
              - metric: exact_match
            """)
    )


def lm_eval(service: Service, tasks: Path, output: Path, gen_kwargs: str | None = None) -> dict:
    """`lm_eval --model local-completions` on the two tasks; returns each task's samples (their responses)."""
    from specdec.common.model_specs import metadata_source

    tokenizer, _ = metadata_source(MODEL)  # the model's own Hugging Face tokenizer files, converted from its GGUF
    model_args = f"model={MODEL},base_url={service.url}/completions,tokenizer={tokenizer},tokenizer_backend=huggingface"
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    command += ["--tasks", "specdec_mc,specdec_gen", "--include_path", str(tasks), "--log_samples", "--output_path", str(output)]
    if gen_kwargs:
        command += ["--gen_kwargs", gen_kwargs]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    samples, results = {}, {}
    for path in output.rglob("*.jsonl"):
        task = path.name.split("samples_")[1].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    for path in output.rglob("results_*.json"):
        results = json.loads(path.read_text())["results"]
    return {"samples": samples, "results": results, "stdout": done.stdout}


def test_lm_evaluation_harness(service, tmp_path):
    pytest.importorskip("lm_eval")
    write_tasks(tmp_path)
    before = service.drafted()
    speculated = lm_eval(service, tmp_path, tmp_path / "speculated", gen_kwargs="num_speculative_tokens=4")
    drafted = service.drafted() - before
    middle = service.drafted()
    alone = lm_eval(service, tmp_path, tmp_path / "alone", gen_kwargs="num_speculative_tokens=0")
    assert service.drafted() == middle, "num_speculative_tokens 0 did not reach the service"
    assert drafted > 0, "speculation did not stay on (the generation task drafts; scoring the choices does not)"
    for task in ("specdec_mc", "specdec_gen"):
        ours = [(s["doc_id"], s["filtered_resps"]) for s in sorted(speculated["samples"][task], key=lambda s: s["doc_id"])]
        theirs = [(s["doc_id"], s["filtered_resps"]) for s in sorted(alone["samples"][task], key=lambda s: s["doc_id"])]
        assert len(ours) == len(MC_QUESTIONS if task == "specdec_mc" else GEN_PROMPTS) and ours == theirs, task
    assert speculated["results"] == alone["results"]
    print(json.dumps({"drafted_tokens": drafted, "results": speculated["results"]}, indent=1))
    print(speculated["stdout"])
