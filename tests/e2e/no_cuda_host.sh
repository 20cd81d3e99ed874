# A CUDA build on a host without CUDA (a CPU node of a mixed cluster, a CI runner): the
# toolkit's library directory is hidden under an empty tmpfs in a private mount namespace.
# dtrain must start, launch and train on CPUs there, and say what is missing when a job asks
# for the GPU trainer or NCCL. 77 = SKIP: a CPU build, or no mount namespaces (not root).
source "$(dirname "$0")/lib.sh"
"$DTRAIN" --version | grep -q "CUDA/NCCL build" || { echo "SKIP: a CPU build"; exit 77; }
unshare -m true 2>/dev/null || { echo "SKIP: cannot make a mount namespace"; exit 77; }
BIN=$(dirname "$(readlink -f "$DTRAIN")")
# Where this machine's loader finds cudart and NCCL (ld.so.cache, the plugins' RUNPATH).
dirs=$( (ldconfig -p | awk '/libcudart\.so|libnccl\.so/ {print $NF}'
         ldd "$BIN/libdtrain_comm_nccl.so" | awk '/libcudart|libnccl/ && $3 ~ /^\// {print $3}') |
       xargs -r -n1 readlink -f | xargs -r -n1 dirname | sort -u)
[ -n "$dirs" ] || { fail "cannot find where cudart and NCCL live"; finish; }
# Hiding a directory hides everything in it: not where the system's own libraries live (a
# distribution's NCCL package installs to /usr/lib/<triplet>).
for d in $dirs; do
  [ -e "$d/libc.so.6" ] || [ -e "$d/libstdc++.so.6" ] &&
    { echo "SKIP: CUDA libraries share $d with the system's; cannot hide them alone"; exit 77; }
done
cat > "$T/tiny.json" <<JSON
{"nproc_per_node": 2, "trainer": {"model": {"layers": [16, 32, 4]}, "data": {"train_samples": 512, "eval_samples": 64},
 "batch_size": 32, "epochs": 1}}
JSON
sed 's/"epochs": 1/"epochs": 1, "device": "cuda"/' "$T/tiny.json" > "$T/cuda.json"
cat > "$T/inside.sh" <<EOF2
set -u
for d in $(echo $dirs); do mount -t tmpfs -o size=1m none "\$d" || exit 9; done
ldd "$DTRAIN" > "$T/ldd" 2>&1; echo "ldd \$?" > "$T/rc"
"$DTRAIN" --version > "$T/version" 2>&1; echo "version \$?" >> "$T/rc"
"$DTRAIN" run "$T/tiny.json" --summary-json "$T/sum.json" > "$T/train.out" 2>&1; echo "train \$?" >> "$T/rc"
"$DTRAIN" run "$T/cuda.json" > "$T/cuda.out" 2>&1; echo "cuda \$?" >> "$T/rc"
"$DTRAIN" bench allreduce --nproc-per-node 2 --backend nccl -n 1 -b 4K -e 4K > "$T/nccl.out" 2>&1; echo "nccl \$?" >> "$T/rc"
EOF2
unshare -m bash "$T/inside.sh"
expect_eq "$?" 0 "the CUDA libraries were hidden"
rc() { awk -v k="$1" '$1 == k {print $2}' "$T/rc"; }
expect_eq "$(rc ldd)" 0 "ldd of dtrain succeeds"
if grep -q "not found" "$T/ldd"; then fail "dtrain needs a library the host lacks: $(grep "not found" "$T/ldd")"; else pass "dtrain links nothing from CUDA"; fi
expect_eq "$(rc version)" 0 "dtrain --version runs"
expect_eq "$(rc train)" 0 "the trainer (device auto) trains on CPUs"
expect_grep "trained: .* weights sha256 [0-9a-f]{64}$" "$T/train.out" "training finished"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d['status']=='succeeded' else 1)" "$T/sum.json" &&
  pass "summary says succeeded" || fail "summary: $(cat "$T/sum.json")"
expect_eq "$(rc cuda)" 2 "device \"cuda\" is refused with exit 2"
# On a host without a GPU driver the launcher's spec check refuses it; on one with GPUs but
# no CUDA runtime, every worker does.
expect_grep "(/trainer/device: \"cuda\" but no GPU is visible here|trainer.device is \"cuda\" but CUDA's runtime cannot be loaded on this host \(.*libcudart)" \
  "$T/cuda.out" "device \"cuda\" says why"
[ "$(rc nccl)" != 0 ] && pass "the NCCL backend fails" || fail "the NCCL backend succeeded without NCCL"
# Without a GPU driver bench refuses it before any rank starts; with GPUs but no NCCL or CUDA
# runtime, the ranks say what is missing.
expect_grep "(--backend: nccl needs a GPU, and none is visible here|backend \"nccl\": cannot load libdtrain_comm_nccl.so \(.*lib(nccl|cudart)[^ ]*: cannot open shared object file.*needs NCCL)" "$T/nccl.out" "NCCL says what is missing"
finish
