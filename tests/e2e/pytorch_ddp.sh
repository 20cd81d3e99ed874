# Real PyTorch (Debian's python3-torch): the unmodified DDP example under dtrain, 2 workers.
source "$(dirname "$0")/lib.sh"
if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  fail "python3-torch is not installed (scripts/setup.sh installs it)"; finish
fi
cd "$SRC"
timeout 150 "$DTRAIN" run --nproc-per-node 2 --env OMP_NUM_THREADS=1 -- /usr/bin/python3 examples/pytorch/ddp_minimal.py >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "DDP job exits 0"
for r in 0 1; do expect_grep "^\[rank $r\] rank $r/2: loss [0-9.]+ weights_in_sync=True$" "$T/out" "rank $r trained in sync"; done

# A worker decorated with PyTorch's @record: its exception reaches the failure summary.
cat > "$T/rec.py" <<'PY'
from torch.distributed.elastic.multiprocessing.errors import record
@record
def main():
    raise ValueError("bad batch size 0")
main()
PY
timeout 100 "$DTRAIN" run --nproc-per-node 1 -- /usr/bin/python3 "$T/rec.py" >"$T/out" 2>"$T/err"
expect_eq "$?" 1 "@record worker exits 1"
expect_grep "error: +.*bad batch size 0" "$T/err" "@record message in the summary"
expect_grep "rec.py" "$T/err" "@record traceback names the script"
finish
