"""lm-evaluation-harness's `local-completions` model, unchanged, against the server: a
loglikelihood task and a generate_until task from local files (the test writes the data and the
task YAML; the tokenizer is the checkpoint's, read from its directory: no hub, no network).

* loglikelihood (lm-eval sends `echo: true, logprobs: 1, max_tokens: 1` over token ids): every
  loglikelihood lm-eval computes equals, bit for bit, the sum of the training forward's
  `model.token_logprobs` over the continuation (the same fp32 values, summed in its order), and
  its is_greedy is the argmax's verdict.
* generate_until (lm-eval sends `stop` strings): each output is the greedy completion cut at the
  first stop string.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="tonp_lm_eval_"))

import lm_eval  # noqa: E402  (after the offline settings: datasets reads them on import)

from serve_utils import ServerProcess, tiny_checkpoint  # noqa: E402
from test_generation import tiny_model  # noqa: E402
from tonp_models import generate  # noqa: E402

NAME = "tiny-lm"
LL_DOCS = [{"context": "Question: 2+2=", "continuation": " 4"},
           {"context": "The sky is", "continuation": " blue today"},
           {"context": "abc", "continuation": "def"}]
GEN_DOCS = [{"question": "Q:", "answer": "A"}, {"question": "Hello", "answer": "hi"}]  # the first
# greedy output (tiny model) holds printable text to stop at
MAX_GEN = 16


def _task(path, name: str, data: list, body: dict) -> None:
    files = path / f"{name}.jsonl"
    files.write_text("".join(json.dumps(d) + "\n" for d in data))
    spec = {"task": name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(files)}}, "test_split": "test", **body}
    (path / f"{name}.yaml").write_text(json.dumps(spec))   # JSON is YAML


def _stop_for(tok, model) -> tuple:
    """The greedy outputs of GEN_DOCS and a two-character stop string inside the first one."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [tok(d["question"])["input_ids"] for d in GEN_DOCS]
    outs = generate(model, ids, MAX_GEN, eos_token_id=eos).completions
    texts = [tok.decode(o.tolist(), skip_special_tokens=True) for o in outs]
    t = texts[0]
    stop = next(t[j:j + 2] for j in range(1, len(t) - 1)
                if t[j:j + 2].isascii() and t[j:j + 2].isprintable() and t.index(t[j:j + 2]) == j)
    return texts, stop


def test_lm_eval_local_completions_loglikelihood_and_generate_until(tmp_path):
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    tok, model = AutoTokenizer.from_pretrained(ckpt), tiny_model(torch.float32)
    texts, stop = _stop_for(tok, model)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _task(tasks, "tonp_ll", LL_DOCS, {
        "output_type": "loglikelihood", "doc_to_text": "{{context}}",
        "doc_to_target": "{{continuation}}", "target_delimiter": "",
        "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]})
    _task(tasks, "tonp_gen", GEN_DOCS, {
        "output_type": "generate_until", "doc_to_text": "{{question}}",
        "doc_to_target": "{{answer}}", "metric_list": [{"metric": "exact_match"}],
        "generation_kwargs": {"until": [stop], "max_gen_toks": MAX_GEN, "do_sample": False,
                              "temperature": 0}})
    with ServerProcess(["--hf", ckpt, "--dtype", "fp32", "--served-model-name", NAME,
                        "--max-batch-size", "4"]) as srv:
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=["tonp_ll", "tonp_gen"],
            task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
            model_args={"model": NAME, "base_url": f"{srv.url}/v1/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": ckpt,
                        "num_concurrent": 1, "max_retries": 1, "timeout": 60,
                        "max_length": 512})
    assert set(out["results"]) == {"tonp_ll", "tonp_gen"}
    ll = sorted(out["samples"]["tonp_ll"], key=lambda s: s["doc_id"])
    assert len(ll) == len(LL_DOCS)
    for s in ll:
        (ctx, cont), = s["arguments"] if isinstance(s["arguments"][0], (list, tuple)) \
            else [s["arguments"]]
        c_ids, cont_ids = tok(ctx)["input_ids"], tok(cont)["input_ids"]
        seq = torch.tensor(c_ids + cont_ids)
        with torch.no_grad():
            lp = model.token_logprobs([seq])[0]
            greedy = model(seq, torch.tensor([0, len(seq)], dtype=torch.int32)).argmax(-1)
        want = sum(lp[len(c_ids) - 1:].tolist())
        (got, is_greedy), = s["resps"][0] if isinstance(s["resps"][0][0], (list, tuple)) \
            else [s["resps"][0]]
        assert got == want, (s["doc"], got, want)           # the same floats, the same sum
        assert is_greedy == bool((greedy[len(c_ids) - 1:-1] == seq[len(c_ids):]).all())
    gen = sorted(out["samples"]["tonp_gen"], key=lambda s: s["doc_id"])
    cut = [t.split(stop)[0] for t in texts]
    assert [s["resps"][0][0] for s in gen] == cut
    assert stop not in cut[0] and len(cut[0]) < len(texts[0])
