"""The GSM8K score (verl_lab_box/gsm8k_score.py).

* the batching that keeps every generate() call within the shape the memory model sized (pure);
* behaviour on CPU with real parts: the tiny Qwen2 model (tests/fixtures/standins/hf_endpoint.py)
  through transformers' ``generate``, the data stage's own test.parquet (verl_lab_box/gsm8k.py),
  verl 0.5.0's own reward function; a re-run changes nothing; and, with the generation replaced by
  known answers, the score counts exactly the right ones (a random model scores 0, which proves
  nothing about the judge);
* the vLLM path at the interface: vLLM cannot run here, so its calls are checked against vLLM
  0.8.5's real signatures, read with ``ast`` from its wheel's source (tests/fixtures/vllm_signatures.py:
  ``LLM.__init__`` and the ``EngineArgs`` its ``**kwargs`` go to, ``LLM.generate``,
  ``SamplingParams``' fields, ``TokensPrompt``, ``CompletionOutput``), statically and through a
  module named ``vllm`` that accepts exactly those and records what the score program asks of it.
  Whether vLLM 0.8.5 then generates the same greedy answers is not tested anywhere.
* the ``final`` flag of a kept score set when the run has since finished at that step.

The score program runs as a child of a preloaded interpreter (tests/fixtures/zygote.py, the ``served`` fixture).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.fixtures.standins import env as standin
from tests.fixtures.standins.hf_endpoint import tiny_gsm8k_parquet, write_tiny_model
from verl_lab_box.gsm8k_score import batches

REPO = Path(__file__).resolve().parents[2]
SCORE = REPO / "verl_lab_box" / "gsm8k_score.py"
ARGS = ["--engine", "hf", "--dtype", "float32", "--batch", "4", "--prompt-len", "128", "--max-new-tokens", "16"]

FAKE_VLLM = '''\
"""A stand-in for vLLM 0.8.5's LLM and SamplingParams that accepts exactly the keywords vLLM
0.8.5's source does (read from its wheel: tests/fixtures/vllm_signatures.py) and records what it
is asked (tests only)."""
import json, os

SIG = json.loads(os.environ["FAKE_VLLM_SIGNATURES"])
__version__ = "0.8.5"


def _record(what, data):
    with open(os.environ["FAKE_VLLM_RECORD"], "a") as fh:
        fh.write(json.dumps({what: data}) + "\\n")


class SamplingParams:
    def __init__(self, **kw):
        unknown = set(kw) - set(SIG["sampling_params"])
        if unknown:
            raise TypeError(f"unexpected SamplingParams fields {sorted(unknown)}")
        self.kw = kw
        _record("sampling", kw)


class _Out:
    def __init__(self, ids):
        self.outputs = [type("CompletionOutput", (), {"token_ids": ids})()]


class LLM:
    def __init__(self, *args, **kw):
        named = SIG["llm_init"][:len(args)]
        kw.update(zip(named, args))
        unknown = set(kw) - set(SIG["llm_init"]) - set(SIG["engine_args"])
        missing = set(SIG["llm_init_required"]) - set(kw)
        if unknown or missing:
            raise TypeError(f"unexpected engine args {sorted(unknown)}, missing {sorted(missing)}")
        _record("llm", kw)

    def generate(self, *args, **kw):
        kw.update(zip(SIG["generate"][:len(args)], args))
        unknown = set(kw) - set(SIG["generate"])
        if unknown:
            raise TypeError(f"generate() got unexpected keyword arguments {sorted(unknown)}")
        prompts = kw["prompts"]
        for p in prompts:
            if not set(p) <= set(SIG["tokens_prompt"]):
                raise TypeError(f"a prompt with keys {sorted(p)} is no TokensPrompt")
        _record("generate", {"prompts": prompts, "use_tqdm": kw.get("use_tqdm", True)})
        answers = json.loads(os.environ["FAKE_VLLM_ANSWERS"])
        return [_Out(answers[i]) for i in range(len(prompts))]
'''


def _vllm_calls() -> dict:
    """The keywords of the score program's vLLM calls (``generate_vllm``), read from its source:
    ``{"LLM": {...}, "SamplingParams": {...}, "generate": {...}}`` plus the positional counts, the
    keys of the prompts it builds and the attributes it reads from the outputs."""
    import ast

    tree = ast.parse((REPO / "verl_lab_box" / "gsm8k_score.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "generate_vllm")
    calls, keys, attrs = {}, set(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name in ("LLM", "SamplingParams", "generate"):
                calls[name] = {"keywords": {k.arg for k in node.keywords}, "positional": len(node.args)}
            if name == "generate":
                prompts = next(k.value for k in node.keywords if k.arg == "prompts")
                keys |= {k.value for d in ast.walk(prompts) if isinstance(d, ast.Dict) for k in d.keys
                         if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Attribute):
            attrs.add(node.attr)
    return {"calls": calls, "prompt_keys": keys, "attributes": attrs}


def test_batches_hold_the_sized_shape_longest_first():
    lengths = [10, 50, 30, 50, 20, 40]
    got = batches(lengths, batch=3, prompt_len=40, new_tokens=10)      # at most 3 x 50 tokens a call
    assert got == [[1, 3], [5, 2, 4], [0]]
    for b in got:
        assert len(b) <= 3 and len(b) * (max(lengths[i] for i in b) + 10) <= 3 * 50
    assert sorted(i for b in got for i in b) == list(range(6))
    assert batches(lengths, 3, 40, 10, rows=[0, 4]) == [[4, 0]]
    assert batches([500], 4, 40, 10) == [[0]]          # one over-long prompt still gets its call


@pytest.fixture(scope="module")
def lab(verl_python, served, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("score")
    root = standin.patched_verl_tree(tmp / "verl")
    model = write_tiny_model(tmp / "model")
    data = tiny_gsm8k_parquet(verl_python, tmp)
    fake = tmp / "fake-vllm"
    fake.mkdir()
    (fake / "vllm.py").write_text(FAKE_VLLM)
    pythonpath = f"{root}{os.pathsep}{REPO / 'verl_lab_box'}"
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}

    def run(*args, extra_env=None, timeout=600):
        full = {**env, **(extra_env or {})}
        return subprocess.run([served.python(full), *map(str, args)], cwd=tmp, env=full, capture_output=True,
                              text=True, timeout=timeout)

    return SimpleNamespace(tmp=tmp, model=model, test=data / "test.parquet", fake=fake, run=run, pythonpath=pythonpath)


@pytest.fixture(scope="module")
def known(lab) -> dict:
    """Ground truths and verl's prompt token ids of the test rows (in row order), from the env: read once, by one
    process, for the three tests that feed them back."""
    code = ("import json, sys, gsm8k_score as g\nfrom transformers import AutoTokenizer\n"
            "rows = g.read_rows(sys.argv[2], None)\ntok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "ids = g.prompt_ids(tok, rows)\n"
            "right = [tok(' so #### ' + r['reward_model']['ground_truth'], add_special_tokens=False)['input_ids'] "
            "for r in rows]\n"
            "wrong = [tok(' so #### 123456789', add_special_tokens=False)['input_ids'] for r in rows]\n"
            "print(json.dumps({'ids': ids, 'right': right, 'wrong': wrong}))")
    res = lab.run("-c", code, lab.model, lab.test)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_tiny_model_is_scored_greedily_and_a_re_run_changes_nothing(lab):
    out = lab.tmp / "base.json"
    res = lab.run(SCORE, "--model", lab.model, "--data", lab.test, "--out", out, "--label", "base", *ARGS)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got["rows"], got["label"], got["step"], got["final"]) == (12, "base", 0, False)
    assert got["engine"] == "hf" and got["dtype"] == "float32" and got["device"] == "cpu"
    assert got["correct"] == round(got["accuracy"] * 12) and got["prompts_per_s"] > 0
    assert got["generate_calls"] >= 3 and got["oom_retries"] == 0          # 12 prompts, at most 4 a call
    assert got["generated_tokens"] <= 12 * 16 and got["reward"] == "verl.utils.reward_score.default_compute_score"
    assert {f["name"] for f in got["model_files"]} >= {"config.json", "model.safetensors", "tokenizer.json"}
    mtime = out.stat().st_mtime_ns
    again = lab.run(SCORE, "--model", lab.model, "--data", lab.test, "--out", out, "--label", "base", *ARGS)
    assert again.returncode == 0 and "already scored" in again.stdout
    assert out.stat().st_mtime_ns == mtime
    other = lab.run(SCORE, "--model", lab.model, "--data", lab.test, "--out", out, "--label", "base", *ARGS[:-1], "8")
    assert other.returncode == 0 and "already scored" not in other.stdout          # other settings: scored again
    assert json.loads(out.read_text())["max_new_tokens"] == 8


def test_verls_judge_counts_exactly_the_right_answers(lab, known):
    """The generation replaced by known responses: right answers for even rows, a wrong number for
    odd ones. The rows are generated longest prompt first, so this also shows answers go back to
    their own rows' ground truths."""
    code = ("import json, sys, gsm8k_score as g\n"
            "known = json.loads(open(sys.argv[1]).read())\n"
            "def fake(args, tok, ids, eos):\n"
            "    assert ids == known['ids']\n"
            "    return [known['right'][i] if i % 2 == 0 else known['wrong'][i] for i in range(len(ids))], {}\n"
            "g.generate_hf = fake\n"
            "sys.exit(g.main(sys.argv[2:]))")
    (lab.tmp / "known.json").write_text(json.dumps(known))
    out = lab.tmp / "judged.json"
    res = lab.run("-c", code, lab.tmp / "known.json", "--model", lab.model, "--data", lab.test, "--out", out,
                  "--label", "global_step_2", "--step", "2", "--final", *ARGS)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got["correct"], got["rows"], got["accuracy"]) == (6, 12, 0.5)
    assert (got["label"], got["step"], got["final"]) == ("global_step_2", 2, True)
    assert [e["score"] for e in got["examples"]] == [1.0, 0.0, 1.0]


def test_the_vllm_calls_are_vllm_085s_own_signatures():
    """Every keyword the score program passes to ``LLM(...)``, ``SamplingParams(...)`` and
    ``llm.generate(...)`` is one vLLM 0.8.5's source takes (its wheel read with ast, never imported),
    its prompts are TokensPrompts and it reads ``token_ids`` of a CompletionOutput. A misspelt or
    removed argument fails here."""
    from tests.fixtures.vllm_signatures import signatures

    sig = signatures()
    assert sig["llm_init_kwargs"] and sig["sampling_params_struct"]        # the forms this check relies on
    assert {"model", "dtype", "gpu_memory_utilization", "tensor_parallel_size", "seed"} <= set(sig["llm_init"])
    assert {"max_num_seqs", "max_model_len", "disable_log_stats"} <= set(sig["engine_args"])
    found = _vllm_calls()
    calls = found["calls"]
    assert set(calls) == {"LLM", "SamplingParams", "generate"}
    llm = calls["LLM"]["keywords"]
    assert not llm - set(sig["llm_init"]) - set(sig["engine_args"]), llm - set(sig["llm_init"]) - set(sig["engine_args"])
    assert set(sig["llm_init_required"]) <= llm and calls["LLM"]["positional"] == 0
    assert not calls["SamplingParams"]["keywords"] - set(sig["sampling_params"])
    assert calls["SamplingParams"]["positional"] == 0
    assert not calls["generate"]["keywords"] - set(sig["generate"]) and calls["generate"]["positional"] == 0
    assert {"prompts", "sampling_params"} <= calls["generate"]["keywords"]
    assert found["prompt_keys"] == {"prompt_token_ids"} <= set(sig["tokens_prompt"])
    assert {"outputs", "token_ids"} <= found["attributes"] and "token_ids" in sig["completion_output"]


def test_the_vllm_engine_is_asked_as_verls_greedy_validation_asks_it(lab, known):
    """Plumbing: what the score program hands vLLM 0.8.5 (a stand-in accepting exactly the keywords
    of vLLM 0.8.5's source), and that it scores vLLM's token ids with the same judge."""
    from tests.fixtures.vllm_signatures import signatures

    record = lab.tmp / "vllm-record.jsonl"
    out = lab.tmp / "vllm.json"
    env = {"PYTHONPATH": f"{lab.fake}{os.pathsep}{lab.pythonpath}", "FAKE_VLLM_RECORD": str(record),
           "FAKE_VLLM_ANSWERS": json.dumps(known["right"]), "FAKE_VLLM_SIGNATURES": json.dumps(signatures())}
    res = lab.run(SCORE, "--model", lab.model, "--data", lab.test, "--out", out, "--label", "base", "--engine", "vllm",
                  "--dtype", "bfloat16", "--batch", "256", "--prompt-len", "128", "--max-new-tokens", "16",
                  "--vllm-share", "0.19", extra_env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    llm = next(c["llm"] for c in calls if "llm" in c)
    assert llm["model"] == str(lab.model) and llm["dtype"] == "bfloat16" and llm["gpu_memory_utilization"] == 0.19
    assert llm["max_num_seqs"] == 256 and llm["tensor_parallel_size"] == 1
    assert llm["max_model_len"] == max(len(i) for i in known["ids"]) + 16
    sampling = next(c["sampling"] for c in calls if "sampling" in c)
    assert {k: sampling[k] for k in ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens")} == \
        {"n": 1, "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 16}
    generate = next(c["generate"] for c in calls if "generate" in c)
    assert generate["prompts"] == [{"prompt_token_ids": i} for i in known["ids"]] and generate["use_tqdm"] is False
    got = json.loads(out.read_text())
    assert (got["engine"], got["correct"], got["vllm"]) == ("vllm", 12, "0.8.5")


def test_a_kept_score_becomes_final_when_the_run_finishes_at_its_step(lab, known):
    """Scored on demand (not final), then asked again with --final once the run finished at that
    step: nothing is generated again, the JSON says final."""
    code = ("import json, sys, gsm8k_score as g\n"
            "known = json.loads(open(sys.argv[1]).read())\n"
            "def fake(args, tok, ids, eos):\n"
            "    print('GENERATED', flush=True)\n"
            "    return [known['right'][i] for i in range(len(ids))], {}\n"
            "g.generate_hf = fake\n"
            "sys.exit(g.main(sys.argv[2:]))")
    (lab.tmp / "known-final.json").write_text(json.dumps(known))
    out = lab.tmp / "global_step_3" / "hf.gsm8k.json"
    out.parent.mkdir()
    args = ["-c", code, lab.tmp / "known-final.json", "--model", lab.model, "--data", lab.test, "--out", out,
            "--label", "global_step_3", "--step", "3", *ARGS]
    first = lab.run(*args)
    assert first.returncode == 0 and "GENERATED" in first.stdout, first.stderr[-3000:]
    assert json.loads(out.read_text())["final"] is False
    again = lab.run(*args, "--final")
    assert again.returncode == 0 and "GENERATED" not in again.stdout, again.stderr[-3000:]
    assert "already scored" in again.stdout and ", final)" in again.stdout
    got = json.loads(out.read_text())
    assert got["final"] is True and got["correct"] == 12
    assert (out.parent / ".export.lock").read_text().endswith(": GSM8K score of global_step_3\n")   # scored under the step's lock
