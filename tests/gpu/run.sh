#!/usr/bin/env bash
# The fork on one CUDA GPU: install it into a fresh venv, run the world-size-1 tests of its ZeRO-3 and
# checkpoint patches with NCCL (bf16 where a test is parametrized by dtype), then the offline tools
# (zero_to_fp32, ds_to_universal) on a ZeRO-3 bf16 checkpoint written on the GPU. Ends with one summary
# line and exits non-zero if anything failed. Without a GPU it says so and exits 0, installing nothing.
#
#   bash tests/gpu/run.sh
#
# Environment (all optional):
#   GPU_CHECK_DIR           work folder: venv, logs, pytest's temp files, the checkpoint (/tmp/ds-fork-gpu-check)
#   GPU_CHECK_LOG_DIR       where the logs go ($GPU_CHECK_DIR/logs)
#   GPU_CHECK_PYTHON        Python that creates the venv (python3; the fork is tested on 3.11)
#   GPU_CHECK_REUSE_VENV=1  keep an existing venv and install nothing (a quick rerun on the same machine)
#   GPU_CHECK_INSTALL_TIMEOUT, GPU_CHECK_TEST_TIMEOUT, GPU_CHECK_TOOLS_TIMEOUT  limits in seconds of
#                           the install, the pytest run and step 4 (240, 240, 90: all within 10 minutes)
#   CUDA_VISIBLE_DEVICES    the GPU to use (0)
#   pip's own (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX, ...) and DS_FORK_SDIST reach the build unchanged.
set -euo pipefail

START=$SECONDS
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

# 1. A GPU, before anything is installed.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "GPU check: no CUDA GPU on this machine (no nvidia-smi); nothing run"
    exit 0
fi
GPU_LIST=$(nvidia-smi -L 2>/dev/null | grep '^GPU ' || true)
if [ -z "$GPU_LIST" ]; then
    echo "GPU check: no CUDA GPU on this machine (nvidia-smi found none); nothing run"
    exit 0
fi
GPU_NAME=$(head -n 1 <<<"$GPU_LIST" | sed -e 's/^GPU [0-9]*: //' -e 's/ (UUID:.*//')

DIR=${GPU_CHECK_DIR:-/tmp/ds-fork-gpu-check}
LOGS=${GPU_CHECK_LOG_DIR:-$DIR/logs}
VENV=$DIR/venv
PY=$VENV/bin/python
mkdir -p "$DIR" "$LOGS"

# The venv's own JIT folder (nothing here should JIT-build: every test uses torch's Adam), one GPU,
# the CUDA accelerator (and so NCCL) named rather than detected, no Hugging Face hub.
export TORCH_EXTENSIONS_DIR=$DIR/torch_extensions
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export DS_ACCELERATOR=cuda
export HF_HUB_OFFLINE=1
unset LOCAL_SIZE

# Ends the run with the one summary line; $1 is the exit status.
summary() {
    echo "GPU check: $SUMMARY; $GPU_NAME; $((SECONDS - START)) s"
    exit "$1"
}
# Seconds left before the deadline $1 (at least 1: "timeout 0" would mean no limit).
left() {
    echo $(($1 - SECONDS > 1 ? $1 - SECONDS : 1))
}
# Shows the end of a log when a step failed.
show_log() {
    echo "--- last lines of $1 ---"
    tail -n "${2:-40}" "$1" || true
    echo "---"
}

# 2. A fresh venv: torch first (pinned, from the default index: pip's Linux wheel is a CUDA build),
# checked to see the GPU, then the fork built from the pinned sdist and the series, and the test
# requirements (which pin the same torch).
INSTALL_TIMEOUT=${GPU_CHECK_INSTALL_TIMEOUT:-240}
if [ "${GPU_CHECK_REUSE_VENV:-0}" = 1 ] && [ -x "$PY" ]; then
    echo "GPU check: reusing $VENV"
else
    echo "GPU check: installing torch==2.13.0 and the fork into $VENV (log: $LOGS/install.log)"
    rm -rf "$VENV" "$TORCH_EXTENSIONS_DIR"
    DEADLINE=$((SECONDS + INSTALL_TIMEOUT))
    if ! { "${GPU_CHECK_PYTHON:-python3}" -m venv "$VENV" &&
        timeout "$(left $DEADLINE)" "$PY" -m pip install torch==2.13.0 &&
        (cd "$REPO" && timeout "$(left $DEADLINE)" "$PY" -m pip install . -r requirements/test.txt); } \
        >"$LOGS/install.log" 2>&1; then
        show_log "$LOGS/install.log"
        SUMMARY="install FAILED or took over $INSTALL_TIMEOUT s (see $LOGS/install.log)"
        summary 1
    fi
fi
if ! timeout 120 "$PY" - >"$LOGS/versions.log" 2>&1 <<'EOF'; then
import torch
assert torch.version.cuda and torch.cuda.is_available(), f"torch {torch.__version__} has no CUDA device"
assert torch.cuda.is_bf16_supported(), f"{torch.cuda.get_device_name(0)} has no bf16"
import deepspeed
from deepspeed.accelerator import get_accelerator
assert get_accelerator().communication_backend_name() == "nccl", get_accelerator()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), deepspeed {deepspeed.__version__}")
print(torch.cuda.get_device_name(0))
EOF
    show_log "$LOGS/versions.log"
    SUMMARY="torch or the fork FAILED to see the GPU (see $LOGS/versions.log)"
    summary 1
fi
GPU_NAME=$(tail -n 1 "$LOGS/versions.log")
echo "GPU check: $(tail -n 2 "$LOGS/versions.log" | head -n 1) on $GPU_NAME"

# 3. The tests, at world size 1 (the harness runs each DistributedTest on the accelerator's backend,
# NCCL here). Left out:
#   runtime/zero/test_zero_empty_params.py::TestZeroEmptyParamsCostNoCollectives  2 ranks only
#   runtime/zero/test_zero_empty_params_features.py  hpz (needs 2 ranks: skipped at 1);
#       offload_states (DeepSpeed's fused Adam: JIT-builds a CUDA op, needs nvcc and minutes)
#   runtime/zero/test_zero_empty_params_hf_trainer.py  the Trainer runs with use_cpu=True (CPU-specific)
#   checkpoint/test_autotp_save_16bit_model.py  every case but test_tp1: tp2 needs 2 or 4 ranks
#       (that includes the bf16 and the state_dict-entries classes)
#   checkpoint/test_checkpoint_killed_save.py  a 2-rank job by design (rank 1 is killed mid-save)
#   checkpoint/test_checkpoint_weights_only.py::TestCheckpointToolsWeightsOnlyFlag  the tools' refusal
#       is CPU-side code covered by the CPU suite; step 4 runs the same tools on a GPU checkpoint
#   examples/test_trainer_resume_other_world_size.py  trains on 2 ranks, and its Trainer uses use_cpu=True
# pytest's -k cannot hold '=' (so not "world_size=1"): the selection is collected first, and the ids
# of the classes that run at several sizes are kept only at world_size=1. -k keeps the bf16 ids of the
# tests parametrized by dtype (the others have none, and run in fp32).
SELECTION=(
    unit/runtime/zero/test_zero_empty_params.py::TestZeroEmptyParams
    unit/runtime/zero/test_zero_empty_params_features.py::TestZeroEmptyParamsFeatures
    unit/checkpoint/test_zero_empty_params_checkpoint.py::TestZeroEmptyParamsCheckpoint
    unit/checkpoint/test_autotp_save_16bit_model.py::TestAutoTPSave16bitModel::test_tp1
    unit/checkpoint/test_load_checkpoint_tag.py::TestZeRO3LoadCheckpointTag
    unit/checkpoint/test_checkpoint_weights_only.py::TestCheckpointWeightsOnly
)
KEEP="not fp32 and not hpz and not offload_states"
PYTEST=("$PY" -m pytest -p no:randomly -p no:cacheprovider)
JUNIT=$LOGS/junit.xml
rm -f "$JUNIT"

cd "$REPO/tests"
IDS=()
if timeout 120 "${PYTEST[@]}" --collect-only -q "${SELECTION[@]}" -k "$KEEP" >"$LOGS/collect.log" 2>&1; then
    mapfile -t IDS < <(grep -E '^unit/[^ ]*::[^ ]*$' "$LOGS/collect.log" | grep -v -E 'world_size=([2-9]|1[0-9])' || true)
fi
if [ "${#IDS[@]}" -eq 0 ]; then
    show_log "$LOGS/collect.log"
    TESTS="collection FAILED (see $LOGS/collect.log)"
    PYTEST_FAILED=1
else
    echo "GPU check: running ${#IDS[@]} tests (log: $LOGS/pytest.log)"
    # SIGINT on timeout: pytest stops the ranks and still writes the junit report of what ran.
    PYTEST_RC=0
    timeout -s INT -k 30 "${GPU_CHECK_TEST_TIMEOUT:-240}" "${PYTEST[@]}" -q --junitxml "$JUNIT" \
        --basetemp "$DIR/pytest-tmp" "${IDS[@]}" >"$LOGS/pytest.log" 2>&1 || PYTEST_RC=$?
    # passed, failed (failures + errors), skipped, from the junit report.
    COUNTS=$("$PY" - "$JUNIT" <<'EOF' 2>/dev/null || true
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
failed = total["failures"] + total["errors"]
print(total["tests"] - failed - total["skipped"], failed, total["skipped"])
EOF
    )
    if [ -n "$COUNTS" ]; then
        read -r NPASS NFAIL NSKIP <<<"$COUNTS"
        TESTS="$NPASS passed, $NFAIL failed, $NSKIP skipped"
    else
        NFAIL=0
        TESTS="no test report"
    fi
    if [ "$PYTEST_RC" -eq 124 ] || [ "$PYTEST_RC" -eq 137 ]; then
        TESTS="$TESTS (timed out after ${GPU_CHECK_TEST_TIMEOUT:-240} s)"
    fi
    PYTEST_FAILED=0
    if [ "$PYTEST_RC" -ne 0 ] || [ "$NFAIL" -ne 0 ]; then
        PYTEST_FAILED=1
        grep -E '^(FAILED|ERROR) ' "$LOGS/pytest.log" || show_log "$LOGS/pytest.log"
        TESTS="$TESTS, pytest exit $PYTEST_RC"
    fi
fi

# 4. The offline tools on a checkpoint written on the GPU: a tiny Llama (from a config, no download)
# trains one step at ZeRO-3 bf16 on one rank and saves; zero_to_fp32 and ds_to_universal convert it.
OFFLINE=$DIR/offline
rm -rf "$OFFLINE"
mkdir -p "$OFFLINE"
TOOLS_TIMEOUT=${GPU_CHECK_TOOLS_TIMEOUT:-90}
DEADLINE=$((SECONDS + TOOLS_TIMEOUT))
MASTER_PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
TOOLS=FAILED
if {
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$MASTER_PORT RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 \
        timeout "$(left $DEADLINE)" "$PY" - "$OFFLINE" <<'EOF' &&
import json
import os
import sys

import torch
import deepspeed
import deepspeed.comm as dist
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
deepspeed.init_distributed(dist_backend="nccl")
torch.manual_seed(42)
model = LlamaForCausalLM(
    LlamaConfig(vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=8))
expected = {
    "state_dict": {name: list(t.shape) for name, t in model.state_dict().items()},
    "parameters": [name for name, _ in model.named_parameters()],
}
config = {
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1000,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3},
}
engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
assert engine.device.type == "cuda", engine.device
ids = torch.randint(0, 64, (2, 8), device=engine.device)
loss = engine(input_ids=ids, labels=ids).loss
engine.backward(loss)
engine.step()
engine.save_checkpoint(os.path.join(out, "ckpt"), tag="step1")
with open(os.path.join(out, "expected.json"), "w") as f:
    json.dump(expected, f)
print(f"trained one step (loss {loss.item():.4f}) and saved {out}/ckpt/step1")
dist.destroy_process_group()
EOF
    timeout "$(left $DEADLINE)" "$PY" -m deepspeed.utils.zero_to_fp32 "$OFFLINE/ckpt" "$OFFLINE/fp32" &&
    timeout "$(left $DEADLINE)" "$PY" -m deepspeed.checkpoint.ds_to_universal --input_folder "$OFFLINE/ckpt/step1" \
        --output_folder "$OFFLINE/universal" &&
    timeout "$(left $DEADLINE)" "$PY" - "$OFFLINE" <<'EOF'
import json
import os
import sys

import torch

out = sys.argv[1]
with open(os.path.join(out, "expected.json")) as f:
    expected = json.load(f)
shapes = {name: tuple(shape) for name, shape in expected["state_dict"].items()}
state_dict = torch.load(os.path.join(out, "fp32", "pytorch_model.bin"), map_location="cpu")
assert {name: tuple(t.shape) for name, t in state_dict.items()} == shapes, sorted(state_dict)
assert all(t.dtype == torch.float32 for t in state_dict.values())
missing = [name for name in expected["parameters"] if not os.path.isfile(os.path.join(out, "universal", "zero", name, "fp32.pt"))]
assert not missing, f"universal checkpoint lacks {missing}"
print(f"zero_to_fp32: the model's {len(shapes)} entries in fp32; ds_to_universal: every parameter")
EOF
} >"$LOGS/offline.log" 2>&1; then
    TOOLS=ok
else
    show_log "$LOGS/offline.log"
fi

# 5. One line.
SUMMARY="$TESTS; offline tools: $TOOLS"
if [ "$PYTEST_FAILED" -ne 0 ] || [ "$TOOLS" != ok ]; then
    summary 1
fi
summary 0
