"""One ``ampaudit.check`` of a transformers Llama (a library model: every line is the library's), for A/B timing.

    python bench/library_check_cost.py dispatch 48       # capture mode, layers
    python bench/library_check_cost.py annotate 48       # only the export capture's line pass, 5 times
    farm-bench -n 5 --vs "env PYTHONPATH=<before> python bench/library_check_cost.py dispatch 48" \\
        -- env PYTHONPATH=<after> python bench/library_check_cost.py dispatch 48

The model is narrow (hidden 64) so the graph, not the arithmetic, is what costs: each layer adds about 90 nodes,
each asking for its source line. Prints the node count, the findings, how many name a library line and the
check's own CPU seconds (on one thread) to stderr. ``annotate`` exports once and times the pass that gives every
node its module and line (``ampaudit.capture.export_capture.annotate``) of the checkout on PYTHONPATH.
"""
from __future__ import annotations

import sys
import time

import torch


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        raise SystemExit(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    import ampaudit

    mode = argv[0] if argv else "dispatch"
    layers = int(argv[1]) if len(argv) > 1 else 48
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=1001, hidden_size=64, intermediate_size=100, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    if mode == "annotate":
        _annotate_cost(model, ids)
        return
    start = time.process_time()
    report = ampaudit.check(model, ids, device="cuda", dtype="float16", capture_mode=mode)
    spent = time.process_time() - start
    library = sum(bool(f.location and f.location.get("library")) for f in report.findings)
    print(f"{report.capture}: {report.nodes} nodes, {len(report.findings)} findings ({library} on a library line), "
          f"check {spent:.2f} s CPU", file=sys.stderr)


def _annotate_cost(model, ids) -> None:
    import inspect

    from ampaudit.capture.export_capture import annotate

    gm = torch.export.export(model, (ids,), strict=False).module()
    takes_root = len(inspect.signature(annotate).parameters) > 1      # older checkouts: annotate(gm)
    runs = []
    for _ in range(5):
        start = time.process_time()
        annotate(gm, model) if takes_root else annotate(gm)
        runs.append(time.process_time() - start)
    print(f"annotate: {len(gm.graph.nodes)} nodes, median {sorted(runs)[2] * 1000:.1f} ms CPU of 5", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
