#!/usr/bin/env bash
# Distributed training with torchrun (torch.distributed.run).
#
# Usage: bash tools/dist_train.sh CONFIG NPROC [train.py args...]
#   NPROC processes per node: GPUs with CUDA (nccl), or CPU processes on a
#   CPU-only machine (gloo, chosen by mmdtr's runner).
# Environment: PORT (29500), NNODES (1), NODE_RANK (0),
#   MASTER_ADDR (127.0.0.1), PYTHON (python).

CONFIG=$1
NPROC=$2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
PYTHON=${PYTHON:-python}

USAGE="usage: $0 CONFIG NPROC [tools/train.py args...]"
if [ -z "$CONFIG" ] || [ -z "$NPROC" ]; then
    echo "$USAGE" >&2
    exit 2
fi
if ! [[ "$NPROC" =~ ^([1-9][0-9]*|auto|cpu|gpu|xpu)$ ]]; then
    # torchrun's own answer would be a traceback
    echo "MmdtrError: mmdtr: NPROC '$NPROC' is not accepted; accepted: a" \
        "positive integer (processes per node) or auto, cpu, gpu, xpu" \
        "(as torchrun's --nproc_per_node). Hint: e.g. $USAGE" >&2
    exit 1
fi
if [ ! -f "$CONFIG" ]; then
    # refused here: from inside torchrun it would end in torchrun's traceback
    echo "MmdtrError: mmdtr: config file '$CONFIG' does not exist." \
        "Hint: give the path of a config file, e.g. configs/demo_dtr.py." >&2
    exit 1
fi
for NAME in NNODES NODE_RANK PORT; do
    VALUE=${!NAME}
    # PORT 0 and a NODE_RANK of no node hung in the rendezvous, silently
    if ! [[ "$VALUE" =~ ^[0-9]{1,9}$ ]] || { [ "$NAME" != NODE_RANK ] && \
            [ "$VALUE" -lt 1 ]; } || { [ "$NAME" = PORT ] && \
            [ "$VALUE" -gt 65535 ]; }; then
        echo "MmdtrError: mmdtr: $NAME '$VALUE' is not accepted; accepted:" \
            "a non-negative integer (NNODES: positive; PORT: 1 to" \
            "65535; NODE_RANK: below NNODES)." \
            "Hint: e.g. NNODES=1 NODE_RANK=0 PORT=29500." >&2
        exit 1
    fi
done
if [ "$NODE_RANK" -ge "$NNODES" ]; then
    echo "MmdtrError: mmdtr: NODE_RANK '$NODE_RANK' is not accepted with" \
        "NNODES '$NNODES'; accepted: 0 to $((NNODES - 1))." \
        "Hint: number the nodes from 0." >&2
    exit 1
fi
for ARG in "${@:3}"; do
    # argparse takes any unique prefix of --launcher (--la, --launch)
    if [[ "${ARG%%=*}" =~ ^--la(u(n(c(h(e(r)?)?)?)?)?)?$ ]]; then
        # it overrode the script's own: one independent run per process
        echo "MmdtrError: mmdtr: '$ARG' is not accepted here: this script" \
            "launches with --launcher pytorch." \
            "Hint: drop it, or run tools/train.py directly." >&2
        exit 1
    fi
done
if [[ "$NPROC" =~ ^(gpu|xpu)$ ]] && ! $PYTHON -c "import sys, torch; \
        sys.exit(not getattr(torch, '$NPROC'.replace('gpu', 'cuda')).is_available())" \
        2>/dev/null; then
    echo "MmdtrError: mmdtr: NPROC '$NPROC': no ${NPROC^^} is available" \
        "here. Hint: give a number of processes, or cpu." >&2
    exit 1
fi

# the config and the arguments, checked once: from the ranks, an error
# would come once per rank and end in torchrun's traceback
PYTHONPATH="$(dirname "$0")/..":$PYTHONPATH \
$PYTHON "$(dirname "$0")/train.py" "$CONFIG" --launcher pytorch \
    --check-config "${@:3}" || exit 1

PYTHONPATH="$(dirname "$0")/..":$PYTHONPATH \
$PYTHON -m torch.distributed.run \
    --nnodes=$NNODES \
    --node_rank=$NODE_RANK \
    --master_addr=$MASTER_ADDR \
    --nproc_per_node=$NPROC \
    --master_port=$PORT \
    "$(dirname "$0")/train.py" \
    "$CONFIG" \
    --launcher pytorch "${@:3}"
