"""tonp's consistency diagnoser: run the same tokens through two paths and name the first op
(layer, op, token positions, max |diff|) whose outputs differ, and why.

    from tonp_models.diagnose import diagnose, write_report
    diag = diagnose(model, seqs, "train", "decode")           # or "invariant", "torch", ...
    print(diag.first)                                         # None: no divergence
    write_report(diag, "out/")                                # out/diagnosis.txt + .json

TP/EP layouts: compare_layouts under torchrun; other engines: compare_external(model,
load_jsonl(path)); the command line: `python -m tonp_models.diagnose --help`.
Modules: capture (forward hooks + the layers' probe seam), paths, compare, layout, report,
external, inputs (JSONL files). docs/diagnose.md explains how it works.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..layers.probe import probe
from .capture import Capture, Record, Trace
from .compare import (CLASSES, COLLECTIVE, OPERATOR, PRECISION, PROPAGATED, ROUTING, WEIGHTS,
                      Diagnosis, OpDiff, compare_traces, differing_parameters)
from .layout import compare_layouts, merge_ranks, run_layout
from .external import (ExternalReport, ExternalSequence, compare_external, load_jsonl,
                       parse_record, write_external_report)
from .paths import PathSpec, run_path
from .report import NO_DIVERGENCE, format_text, to_json, write_report


def diagnose(model, sequences: Sequence[torch.Tensor], a: Union[str, PathSpec] = "train",
             b: Union[str, PathSpec] = "decode", *, model_b=None,
             prompt_lens: Optional[Sequence[int]] = None,
             out_dir: Optional[str] = None) -> Diagnosis:
    """Run `sequences` (1-D int64 token ids) through path `a` on `model` and path `b` on
    `model_b` (default: the same model) in this process, and compare them op by op.

    a, b: PathSpec or its text ("train", "decode", "padded", "invariant", "torch",
        "decode,torch", ...). TP/EP layouts need torchrun: see compare_layouts.
    prompt_lens: prefill lengths for a decode path (default half of each sequence).
    out_dir: if given, also write diagnosis.txt and diagnosis.json there.
    """
    specs = [PathSpec.parse(s) if isinstance(s, str) else s for s in (a, b)]
    for s in specs:
        if s.tp > 1 or s.ep > 1:
            raise ValueError(f"diagnose: path {s.label} needs several ranks; run under torchrun "
                             f"(python -m tonp_models.diagnose ... or compare_layouts)")
    labels = [s.label for s in specs]
    if labels[0] == labels[1]:
        labels = [labels[0] + " (A)", labels[1] + " (B)"]
    traces = [run_path(m, sequences, s.kind, mode=s.mode, prompt_lens=prompt_lens, label=lab)
              for m, s, lab in zip((model, model_b or model), specs, labels)]
    diag = compare_traces(*traces, differing_parameters(model, model_b or model))
    if out_dir is not None:
        write_report(diag, out_dir)
    return diag


__all__ = ["diagnose", "Capture", "Record", "Trace", "probe", "PathSpec", "run_path",
           "compare_traces", "differing_parameters", "Diagnosis", "OpDiff", "CLASSES",
           "OPERATOR", "ROUTING", "COLLECTIVE", "PRECISION", "WEIGHTS", "PROPAGATED",
           "format_text", "to_json", "write_report", "NO_DIVERGENCE", "ExternalSequence",
           "ExternalReport", "parse_record", "load_jsonl", "compare_external",
           "write_external_report", "compare_layouts", "run_layout", "merge_ranks"]
