"""One ``ampaudit.check`` of a transformers Llama (a library model: every line is the library's), for A/B timing.

    python bench/library_check_cost.py dispatch 48       # capture mode, layers
    farm-bench -n 5 --vs "env PYTHONPATH=<before> python bench/library_check_cost.py dispatch 48" \\
        -- env PYTHONPATH=<after> python bench/library_check_cost.py dispatch 48

The model is narrow (hidden 64) so the graph, not the arithmetic, is what costs: each layer adds about 90 nodes,
each asking for its source line. Prints the node count, the findings, how many name a library line and the
check's own CPU seconds (on one thread) to stderr.
"""
from __future__ import annotations

import sys
import time

import torch


def main(argv: list[str]) -> None:
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
    start = time.process_time()
    report = ampaudit.check(model, ids, device="cuda", dtype="float16", capture_mode=mode)
    spent = time.process_time() - start
    library = sum(bool(f.location and f.location.get("library")) for f in report.findings)
    print(f"{report.capture}: {report.nodes} nodes, {len(report.findings)} findings ({library} on a library line), "
          f"check {spent:.2f} s CPU", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
