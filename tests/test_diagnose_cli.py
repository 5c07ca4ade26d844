"""The diagnoser's command line on the inputs a user gives it: examples/rollout.py's own output,
--threshold 0, infinite logprobs, and bad files, each a one-line error naming file and line
(exit code 2, no traceback)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

from tonp_models import diagnose as dg
from tonp_models.diagnose.__main__ import main as cli_main

sys.path.insert(0, os.path.dirname(__file__))
from model_helpers import invariant_built, random_seqs, tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not invariant_built(), reason="tonp_kernels C++ ops not built")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = ["--preset", "tiny", "--seed", "0"]


def _strict_json(path):
    """The file parsed by a strict JSON reader (no NaN / Infinity literals)."""
    def refuse(name):
        raise AssertionError(f"{path}: {name} is not JSON")
    with open(path) as fh:
        return json.load(fh, parse_constant=refuse)


def _rollout(path, *extra):
    """examples/rollout.py's own output for the tiny preset with weights seed 0."""
    spec = importlib.util.spec_from_file_location("rollout_example",
                                                  os.path.join(ROOT, "examples", "rollout.py"))
    rollout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rollout)
    assert rollout.main(["--preset", "tiny", "--weights-seed", "0", "--token-ids", "1,2,3",
                         "--token-ids", "7,8,9,10,11", "--max-new-tokens", "6", "--seed", "5",
                         "--out", str(path), *extra]) == 0
    return [json.loads(line) for line in open(path)]


def test_reads_rollout_output(tmp_path):
    """rollout.py's JSONL (prompt_ids, completion_ids, completion logprobs) is read by --external
    (bitwise equal at its temperature; one perturbed logprob found at its token) and by --tokens
    (its prompts prefilled, its completions decoded: no divergence)."""
    path = tmp_path / "rollouts.jsonl"
    rows = _rollout(path, "--temperature", "0.7")
    assert [len(r["prompt_ids"]) for r in rows] == [3, 5] and "logprobs" in rows[0]
    out = tmp_path / "out"
    assert cli_main(PRESET + ["--external", str(path), "--temperature", "0.7", "--threshold",
                              "0", "--out", str(out)]) == 0
    body = _strict_json(out / "external.json")
    assert body["tokens_compared"] == 12 and body["tokens_not_bitwise_equal"] == 0, body
    rows[1]["logprobs"][2] += 0.25                      # completion token 2 of sequence 1
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    assert cli_main(PRESET + ["--external", str(path), "--temperature", "0.7", "--out",
                              str(out)]) == 0
    body = _strict_json(out / "external.json")
    assert body["tokens_over_threshold"] == 1 and body["first_divergent"][0] is None
    assert body["first_divergent"][1]["index"] == 5 + 2
    assert cli_main(PRESET + ["--tokens", str(path), "--paths", "train:decode", "--out",
                              str(out)]) == 0
    diag = _strict_json(out / "diagnosis.json")
    assert diag["result"] == dg.NO_DIVERGENCE and diag["ops"][0]["rows_compared"] == 9 + 11


def _external(tmp_path, model, seqs, edit):
    lps = [lp.tolist() for lp in model.token_logprobs(seqs)]
    recs = [{"token_ids": s.tolist(), "logprobs": lp} for s, lp in zip(seqs, lps)]
    edit(recs)
    path = tmp_path / "ext.jsonl"
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in recs)
    return path


def test_threshold_zero_and_infinite_logprobs(tmp_path):
    """--threshold 0 flags anything not bitwise equal, and an engine's -inf logprob is one
    divergent token: both write the text, strict JSON and the histogram."""
    torch.manual_seed(0)
    model = tiny_model("mlp_only", seed=0)
    seqs = random_seqs((6, 5), model.config.vocab_size, seed=4)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)

    def edit(recs):
        recs[0]["logprobs"][2] = -math.inf              # token 3 of sequence 0
        recs[1]["logprobs"][1] += 1e-6                  # token 2 of sequence 1: tiny, not 0
    path = _external(tmp_path, model, seqs, edit)
    out = tmp_path / "out"
    assert cli_main(["--hf", str(ckpt), "--external", str(path), "--threshold", "0",
                     "--out", str(out)]) == 0
    body = _strict_json(out / "external.json")
    assert body["tokens_over_threshold"] == body["tokens_not_bitwise_equal"] == 2
    assert body["max_abs_diff"] == "inf" and body["first_divergent"][0]["diff"] == "-inf"
    assert body["first_divergent"][1]["index"] == 2
    assert os.path.getsize(out / "external_hist.png") > 1000
    assert "|diff| > 0:" in open(out / "external.txt").read()


def _bad(tmp_path, name, content):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


_LP = [None, -1.0, -2.0]
BAD_FILES = [  # (option, file content (None = missing), expected message after "<file>")
    ("--external", None, ": No such file or directory"),
    ("--external", "", ": no records (the file is empty)"),
    ("--external", "\n  \n", ": no records (the file is empty)"),
    ("--external", json.dumps({"token_ids": [1, 2, 3], "logprobs": _LP}) + "\n\xff\n",
     ":2: not valid JSON"),
    ("--external", b'{"token_ids": [1, 2, 3], "logprobs": [null, -1, -2]}\n{"a\xff": 1}\n',
     ":2: not UTF-8 text (byte 0xff at column 4)"),
    ("--external", "[1, 2, 3]\n", ":1: expected one JSON object per line, got an array"),
    ("--external", '{"token_ids": [1, 2, 3], "logprobs": [0, 0, 0, 0, 0]}',
     ":1: 5 logprobs for 3 tokens"),
    ("--external", '{"token_ids": "1 2 3", "logprobs": [0, 0]}',
     ":1: 'token_ids' must be an array of token ids, got a string"),
    ("--external", '{"token_ids": [1, 2.5, 3], "logprobs": [0, 0]}',
     ":1: 'token_ids'[1] = 2.5 is not a token id"),
    ("--external", '{"token_ids": [1, 2, 3], "logprobs": "-1 -2"}',
     ":1: 'logprobs' must be an array"),
    ("--external", '{"token_ids": [1, 2, 3], "logprobs": ["a", -2]}',
     ":1: logprob of token 1: cannot read a logprob from 'a'"),
    ("--external", '{"token_ids": [1, 2, 3], "logprobs": [-1, NaN]}',
     ":1: logprob of token 2: the logprob is NaN"),
    ("--external", '{"token_ids": [1, 2, 99999], "logprobs": [-1, -2]}',
     ":1: token ids [99999] are outside the model's vocabulary [0, 320)"),
    ("--external", '{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "logprobs": [-1, -2]}',
     ":1: 2 logprobs for 3 completion tokens"),
    ("--external", '{"prompt_token_ids": [1, 2], "outputs": [{"logprobs": []}]}',
     ":1: unreadable record (KeyError: 'token_ids')"),
    ("--tokens", '{"token_ids": [1, 2, 3], "prompt_len": 0}',
     ":1: 'prompt_len' = 0 must be an integer in [1, 3]"),
    ("--tokens", '{"ids": [1, 2, 3]}', ":1: expected 'token_ids'"),
    ("--tokens", '{"prompt_ids": [], "completion_ids": [4, 5]}', ":1: 'prompt_ids' is empty"),
    ("--tokens", '{"token_ids": []}', ":1: the sequence has no tokens"),
]


@pytest.mark.parametrize("option,content,message", BAD_FILES,
                         ids=[f"{o[2:]}-{m.split(':')[-1].strip()[:30]}" for o, _, m in BAD_FILES])
def test_bad_input_files_are_one_line_errors(tmp_path, capsys, option, content, message):
    path = _bad(tmp_path, "in.jsonl", content)
    extra = ["--paths", "train:decode"] if option == "--tokens" else []
    assert cli_main(PRESET + [option, path, *extra, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{path}{message}" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args,message", [
    (["--paths", "train"], "two paths joined by ':'"),
    (["--paths", "train:fast"], "unknown part 'fast'"),
    (["--paths", "train:train"], "both sides are the same path"),
    (["--paths", "train:decode", "--prompt-len", "30"], "prompt_lens [30] must give"),
])
def test_bad_paths_are_one_line_errors(tmp_path, capsys, args, message):
    assert cli_main(PRESET + args + ["--num-seqs", "2", "--seq-len", "6", "--out",
                                     str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("args", [["--threshold", "-1"], ["--threshold", "nan"],
                                  ["--temperature", "0"], ["--temperature", "inf"],
                                  ["--num-seqs", "0"], ["--seq-len", "x"]])
def test_bad_numbers_are_refused_by_argparse(tmp_path, capsys, args):
    with pytest.raises(SystemExit) as e:
        cli_main(PRESET + args + ["--out", str(tmp_path / "o")])
    assert e.value.code == 2 and args[0] in capsys.readouterr().err


def test_api_refuses_bad_thresholds_and_records():
    model = tiny_model("mlp_only", seed=0)
    seq = dg.parse_record({"token_ids": [1, 2, 3], "logprobs": [-1.0, -2.0]})
    for kw in (dict(threshold=-1.0), dict(threshold=math.nan), dict(temperature=0.0)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            dg.compare_external(model, [seq], **kw)
    with pytest.raises(ValueError, match="expected a JSON object"):
        dg.parse_record([1, 2, 3])
