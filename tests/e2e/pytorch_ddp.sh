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
# Rank 0 ends first while rank 1 still uses torch's default store, which is rank 0's under
# dtrain (TORCHELASTIC_USE_AGENT_STORE=False): the error says only "Broken pipe"; the summary
# says why, and the fix. A job whose ranks end together gets no such hint.
cat > "$T/early.py" <<'PY'
import sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()
t = torch.ones(1); dist.all_reduce(t)
if dist.get_rank() == 0: sys.exit(0)
time.sleep(1)
store.set("k", "v")  # (the line names no torch: only "RuntimeError: Broken pipe" says it)
PY
timeout 100 "$DTRAIN" run --nproc-per-node 2 --env OMP_NUM_THREADS=1 -- /usr/bin/python3 "$T/early.py" >"$T/out" 2>"$T/err"
expect_eq "$?" 1 "rank 0 gone before rank 1's store call: the job fails"
expect_grep "^    hint: +rank 0 had exited 0 before \(.*\): torch's default store is rank 0's \(TORCHELASTIC_USE_AGENT_STORE=False\)" "$T/err" "rank 0 gone first: the hint names the store"
timeout 100 "$DTRAIN" run --nproc-per-node 2 -- /usr/bin/python3 -c 'import sys; sys.exit(int(__import__("os").environ["RANK"]) * 3)' >"$T/out" 2>"$T/err"
expect_eq "$?" 3 "rank 1 fails on its own"
expect_no_grep "hint:" "$T/err" "a failure not about the store: no hint"
# A lost connection of the script's own (no torch in what it said): no store hint either.
cat > "$T/fetch.py" <<'PY'
import os, sys, time, urllib.request
if os.environ["RANK"] == "0": sys.exit(0)
time.sleep(0.5); urllib.request.urlopen("http://127.0.0.1:9/metrics")
PY
timeout 100 "$DTRAIN" run --nproc-per-node 2 -- /usr/bin/python3 "$T/fetch.py" >"$T/out" 2>"$T/err"
expect_eq "$?" 1 "rank 1's own connection refused: the job fails"
expect_grep "Connection refused" "$T/err" "rank 1's own connection refused: said"
expect_no_grep "default store" "$T/err" "rank 1's own connection refused: no torch store hint"
finish
