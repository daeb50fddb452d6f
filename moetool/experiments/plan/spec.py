"""Memory and speed plan of a checkpoint on given GPUs, from its config alone (no weights are read).

Parameter bytes by group and format (bf16, the checkpoint's own format such as fp8 or mxfp4, fp8 with
128x128 block scales), activations and KV cache per row, which layouts fit (one GPU per replica with data
parallel, --quantize fp8, --device-map auto over one node, tensor+expert parallel over every GPU) with
the command to run, and a ceiling in tokens/s per command from dense peak FLOP/s and HBM bandwidth
(upper bounds: min of the compute and the weight-reading ceilings).

GPUs: H100, H200, B200, A100-80, A100-40, L40S, RTX4090 (vendor datasheet rates, dense, no sparsity).
A layout may use 90% of a GPU's memory. Writes params.csv, layouts.csv (with why each layout runs or not),
throughput.csv (when a layout fits) and manifest.json. No layout fitting is an answer (exit 0), not an error.

Examples:
  moetool plan --model examples/configs/mixtral-8x7b --gpus 1xH100
  moetool plan --model examples/configs/deepseek-v3 --gpus 8xH100 --nodes 2
  moetool plan --model qwen3-30b-a3b --gpus 8xA100-80 --json
"""

from __future__ import annotations

from ..experiment import Flag, experiment

SPEC = experiment("plan", "plan", None, inputs="config", lines=None,
                  order=190,
                  flags=(Flag("--gpus", "str", "8xH100", "GPUs per node, COUNTxNAME (e.g. 8xH100, 1xRTX4090)."),
                         Flag("--nodes", "int", 1, "Nodes (each with --gpus).", min=1),
                         Flag("--seq-len", "int", None, "Tokens per row the commands would run (default 2048, or the "
                              "model's positions when it has fewer).", min=2),
                         Flag("--batch-size", "int", 8, "Rows per batch the commands would run.", min=1),
                         Flag("--json", "bool", False, "Print the tables as JSON (no run folder).")))
