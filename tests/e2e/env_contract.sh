# Three workers get the full torchrun environment, with spec env and --env on top.
source "$(dirname "$0")/lib.sh"
cat > "$T/job.json" <<JSON
{"name": "envtest", "command": ["sh", "-c", "env > $T/env.\$RANK"], "nproc_per_node": 3,
 "max_restarts": 4, "env": {"FROM_SPEC": "yes", "ROLE_NAME": "trainer-overridden"}}
JSON
env -u OMP_NUM_THREADS -u PYTHONUNBUFFERED NCCL_ASYNC_ERROR_HANDLING=0 "$DTRAIN" run "$T/job.json" --env FROM_CLI=1 --env "WITH_EQ=a=b" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "3 workers exit 0"
expect_grep "OMP_NUM_THREADS=1 for each of the 3 workers" "$T/err" "OMP notice printed"
ports=()
for r in 0 1 2; do
  f="$T/env.$r"
  [ -f "$f" ] || { fail "rank $r wrote no env"; continue; }
  v() { grep -E "^$1=" "$f" | head -1 | cut -d= -f2-; }
  expect_eq "$(v RANK)" "$r" "rank $r RANK"
  expect_eq "$(v LOCAL_RANK)" "$r" "rank $r LOCAL_RANK"
  expect_eq "$(v ROLE_RANK)" "$r" "rank $r ROLE_RANK"
  expect_eq "$(v GROUP_RANK)" 0 "rank $r GROUP_RANK"
  expect_eq "$(v WORLD_SIZE)" 3 "rank $r WORLD_SIZE"
  expect_eq "$(v LOCAL_WORLD_SIZE)" 3 "rank $r LOCAL_WORLD_SIZE"
  expect_eq "$(v ROLE_WORLD_SIZE)" 3 "rank $r ROLE_WORLD_SIZE"
  expect_eq "$(v GROUP_WORLD_SIZE)" 1 "rank $r GROUP_WORLD_SIZE"
  # The DeepSpeed launcher's names for the layout; MPI's and Horovod's are not set.
  expect_eq "$(v LOCAL_SIZE)" 3 "rank $r LOCAL_SIZE"
  expect_eq "$(v CROSS_RANK)" 0 "rank $r CROSS_RANK"
  expect_eq "$(v CROSS_SIZE)" 1 "rank $r CROSS_SIZE"
  expect_eq "$(grep -cE '^(OMPI_COMM_WORLD_|PMI_|PMIX_RANK|HOROVOD_)' "$f")" 0 "rank $r no MPI/Horovod variables"
  expect_eq "$(v MASTER_ADDR)" 127.0.0.1 "rank $r MASTER_ADDR"
  expect_eq "$(v TORCHELASTIC_RESTART_COUNT)" 0 "rank $r restart count"
  expect_eq "$(v TORCHELASTIC_MAX_RESTARTS)" 4 "rank $r max restarts"
  expect_eq "$(v TORCHELASTIC_USE_AGENT_STORE)" False "rank $r agent store"
  expect_eq "$(v OMP_NUM_THREADS)" 1 "rank $r OMP_NUM_THREADS"
  expect_eq "$(v PYTHONUNBUFFERED)" 1 "rank $r PYTHONUNBUFFERED (torchrun's python -u)"
  expect_eq "$(v TORCH_NCCL_ASYNC_ERROR_HANDLING)" 1 "rank $r TORCH_NCCL_ASYNC_ERROR_HANDLING"
  expect_eq "$(v NCCL_ASYNC_ERROR_HANDLING)" 0 "rank $r the user's NCCL_ASYNC_ERROR_HANDLING kept"
  expect_eq "$(v FROM_SPEC)" yes "rank $r spec env"
  expect_eq "$(v FROM_CLI)" 1 "rank $r --env"
  expect_eq "$(v WITH_EQ)" "a=b" "rank $r --env value with ="
  expect_eq "$(v ROLE_NAME)" trainer-overridden "rank $r spec env wins"
  expect_eq "$(v TORCHELASTIC_RUN_ID)" "$(v DTRAIN_RUN_ID)" "rank $r run ids agree"
  [[ "$(v TORCHELASTIC_ERROR_FILE)" == */attempt_0/$r/error.json ]] && pass "rank $r error file" || fail "rank $r error file: $(v TORCHELASTIC_ERROR_FILE)"
  ports+=("$(v MASTER_PORT)")
  ids+=("$(v TORCHELASTIC_RUN_ID)")
done
expect_eq "${ports[0]}" "${ports[1]}" "same MASTER_PORT for ranks 0 and 1"
expect_eq "${ports[0]}" "${ports[2]}" "same MASTER_PORT for ranks 0 and 2"
sp=$(grep -E "^DTRAIN_STORE_PORT=" "$T/env.0" | cut -d= -f2)
[ -n "$sp" ] && [ "${ports[0]}" != "$sp" ] && [ "${ports[0]}" -gt 0 ] && pass "MASTER_PORT distinct from the store port" || fail "bad MASTER_PORT ${ports[0]} (store $sp)"
expect_eq "$(grep -E "^DTRAIN_STORE_ADDR=" "$T/env.0" | cut -d= -f2)" 127.0.0.1 "store address"
tok=$(grep -E "^DTRAIN_STORE_TOKEN=" "$T/env.0" | cut -d= -f2)
[[ "$tok" =~ ^[0-9a-f]{64}$ ]] && pass "store token is 32 random bytes in hex" || fail "bad token '$tok'"
expect_eq "$(grep -E "^DTRAIN_STORE_TOKEN=" "$T/env.2" | cut -d= -f2)" "$tok" "same token for every rank"
expect_eq "${ids[0]}" "${ids[2]}" "same run id"
expect_eq "$(grep -E "^DTRAIN_BIN=" "$T/env.1" | cut -d= -f2)" "$(readlink -f "$DTRAIN")" "DTRAIN_BIN: the running dtrain, absolute"
# A worker reaches the job's store through it with dtrain off its PATH (run by path).
"$DTRAIN" run --nproc-per-node 1 --env PATH=/usr/bin:/bin -- sh -c 'command -v dtrain; "$DTRAIN_BIN" store set k v && "$DTRAIN_BIN" store get k' >"$T/out3" 2>"$T/err3"
expect_eq "$(cat "$T/out3")" "[rank 0] v" "a worker's \$DTRAIN_BIN store get, dtrain not on PATH"

# A user's OMP_NUM_THREADS is kept, and no notice is printed.
OMP_NUM_THREADS=7 "$DTRAIN" run --nproc-per-node 2 -- sh -c 'echo "omp=$OMP_NUM_THREADS"' >"$T/out2" 2>"$T/err2"
expect_grep "^\[rank 1\] omp=7$" "$T/out2" "user OMP_NUM_THREADS kept"
if grep -q OMP_NUM_THREADS "$T/err2"; then fail "notice printed although the user set OMP_NUM_THREADS"; else pass "no notice"; fi
# Under mpirun: the MPI rank dtrain inherited is not passed to every worker; MPI settings are.
OMPI_COMM_WORLD_RANK=5 PMI_RANK=5 OMPI_MCA_btl=self "$DTRAIN" run --no-prefix -- sh -c 'echo "${OMPI_COMM_WORLD_RANK-unset} ${PMI_RANK-unset} $OMPI_MCA_btl"' >"$T/mpi.out" 2>&1
expect_eq "$(cat "$T/mpi.out")" "unset unset self" "an inherited MPI identity is dropped, MPI settings kept"
finish
