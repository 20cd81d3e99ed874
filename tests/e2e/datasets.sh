# The trainer on file data sets: csv (header, label column) and MNIST-format idx files,
# trained by 2 workers; bad data is refused before any worker starts.
source "$(dirname "$0")/lib.sh"
# A csv that validate refuses, exit 2, saying PATTERN (CONTENT is printf's format: \n, \0).
csv_refused() {  # CONTENT PATTERN WHAT
  printf "$1" > "$T/bad.csv"
  "$DTRAIN" validate "$T/bad.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "$3: exit 2"
  expect_grep "$2" "$T/err" "$3: said"
}
python3 - "$T" <<'PY'
import random, struct, sys
t = sys.argv[1]
rnd = random.Random(3)
centers = [[rnd.uniform(-3, 3) for _ in range(4)] for _ in range(3)]
def row():
    c = rnd.randrange(3)
    return [centers[c][i] + rnd.gauss(0, 0.6) for i in range(4)], c
with open(f"{t}/train.csv", "w") as f:
    f.write("f1,f2,label,f3,f4\n")
    for _ in range(3000):
        x, c = row()
        f.write(f"{x[0]:.4f},{x[1]:.4f},{c},{x[2]:.4f},{x[3]:.4f}\n")
with open(f"{t}/bad.csv", "w") as f:
    f.write("f1,f2,label,f3,f4\n1,2,0,3,4\n1,2,1,x3,4\n")
# idx: 8x8 images, 4 classes: a bright 4x4 quadrant per class plus noise.
def images(n, path, lpath):
    with open(path, "wb") as fi, open(lpath, "wb") as fl:
        fi.write(struct.pack(">IIII", 0x803, n, 8, 8))
        fl.write(struct.pack(">II", 0x801, n))
        for _ in range(n):
            c = rnd.randrange(4)
            px = bytearray(64)
            for r in range(8):
                for col in range(8):
                    q = (r // 4) * 2 + col // 4
                    v = (200 if q == c else 30) + rnd.randint(-30, 30)
                    px[r * 8 + col] = max(0, min(255, v))
            fi.write(bytes(px))
            fl.write(bytes([c]))
images(2000, f"{t}/train-images.idx3-ubyte", f"{t}/train-labels.idx1-ubyte")
images(400, f"{t}/t10k-images.idx3-ubyte", f"{t}/t10k-labels.idx1-ubyte")
PY
cat > "$T/csv.json" <<JSON
{"nproc_per_node": 2, "trainer": {"model": {"layers": [4, 32, 3]},
 "data": {"type": "csv", "path": "$T/train.csv", "label_column": "label"},
 "batch_size": 32, "epochs": 5, "optimizer": {"lr": 0.05, "momentum": 0.9}, "log_every_steps": 1000}}
JSON
"$DTRAIN" run "$T/csv.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "csv job"
acc=$(sed -n 's/.*eval accuracy \([0-9.]*\)%.*/\1/p' "$T/out")
python3 -c "import sys; sys.exit(0 if float('${acc:-0}') >= 90 else 1)" && pass "csv held-out accuracy ${acc}%" || fail "csv accuracy ${acc}: $(cat "$T/out" "$T/err")"
# 3000 rows, the last 10% held out: 2700 / (32 x 2) = 42 steps per epoch.
expect_grep "trained: 210 steps" "$T/out" "csv: 10% held out, drop_last steps"
cat > "$T/idx.json" <<JSON
{"nproc_per_node": 2, "trainer": {"model": {"layers": [64, 32, 4]},
 "data": {"type": "idx", "path": "$T/train-images.idx3-ubyte", "labels_path": "$T/train-labels.idx1-ubyte",
          "eval_path": "$T/t10k-images.idx3-ubyte", "eval_labels_path": "$T/t10k-labels.idx1-ubyte"},
 "batch_size": 25, "epochs": 3, "optimizer": {"type": "adamw", "lr": 0.01}, "log_every_steps": 1000}}
JSON
"$DTRAIN" run "$T/idx.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "idx job"
acc=$(sed -n 's/.*eval accuracy \([0-9.]*\)%.*/\1/p' "$T/out")
python3 -c "import sys; sys.exit(0 if float('${acc:-0}') >= 95 else 1)" && pass "idx held-out accuracy ${acc}%" || fail "idx accuracy ${acc}: $(cat "$T/out" "$T/err")"
expect_grep "trained: 120 steps" "$T/out" "idx: 2000 / 50 x 3 epochs"
# The workers map the launcher's parse (the data image) instead of parsing the files again;
# the same training without it (DTRAIN_DATA_SHARE=0) ends with the same weights.
expect_grep "^\[rank 0\] trainer: data mapped from this host's data image \([0-9]+ KiB\), shared by this host's workers$" "$T/out" "idx: workers map the data image"
sha=$(sed -n 's/.*weights sha256 \([0-9a-f]*\).*/\1/p' "$T/out")
DTRAIN_DATA_SHARE=0 "$DTRAIN" run "$T/idx.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "idx job, DTRAIN_DATA_SHARE=0"
expect_no_grep "data image" "$T/out" "DTRAIN_DATA_SHARE=0: no image"
expect_grep "weights sha256 ${sha:-none}" "$T/out" "the image and the files train the same weights"
# dtrain started with stdin closed (main() puts /dev/null there first): the image still goes
# to the workers above their 0-2.
"$DTRAIN" run "$T/idx.json" >"$T/out" 2>"$T/err" <&-
expect_eq "$?" 0 "idx job with stdin closed"
expect_grep "trainer: data mapped from this host's data image" "$T/out" "stdin closed: the workers map the image"
# A DTRAIN_DATA_FD in dtrain's own environment is not this job's: its workers never see it.
DTRAIN_DATA_FD=5 "$DTRAIN" run -- sh -c 'echo "fd=${DTRAIN_DATA_FD:-unset}"' >"$T/out" 2>"$T/err" 5<"$T/idx.json"
expect_grep "fd=unset$" "$T/out" "an outer DTRAIN_DATA_FD is not passed on"
DTRAIN_DATA_SHARE=maybe "$DTRAIN" run "$T/idx.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "DTRAIN_DATA_SHARE=maybe exits 2"
expect_grep 'DTRAIN_DATA_SHARE="maybe": expected 0 or 1' "$T/err" "DTRAIN_DATA_SHARE=maybe: said"
# dtrain's other switches too, before any worker starts (the workers read DTRAIN_COMM_SHM).
for v in DTRAIN_COMM_SHM DTRAIN_MEMORY_CHECK; do
  env $v=maybe "$DTRAIN" run "$T/idx.json" >"$T/out" 2>"$T/err"
  expect_eq "$?" 2 "$v=maybe exits 2"
  expect_eq "$(cat "$T/err")" "dtrain: error: $v=\"maybe\": expected 0 or 1 (also off/on, false/true, no/yes)" "$v=maybe: one line, before the launch"
done
# Bad data: refused with file:line and column, exit 2, nothing started.
sed "s|train.csv|bad.csv|" "$T/csv.json" > "$T/bad.json"
"$DTRAIN" run "$T/bad.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "bad csv exits 2"
expect_grep "^dtrain: error: .*bad.csv:3: column 3 \(0-based, as /trainer/data/label_column counts\) is not a number \(\"x3\"\); every cell must be a number \(the label a class index\): fix or drop the row$" "$T/err" "bad csv names line and column, and the fix"
# A file without a header under the default header: true (its first row was taken for the
# names and dropped), a gzip-compressed csv, float32's largest as numpy prints it.
printf '1,2,0,3,4\n1,2,1,3,4\n' > "$T/bad.csv"
sed 's|"label_column": "label"|"label_column": "2"|' "$T/bad.json" > "$T/numhdr.json"
"$DTRAIN" validate "$T/numhdr.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a data row read as the header: exit 2"
expect_grep 'bad.csv:1: the header line holds only numbers \("1,2,0,3,4"\): a data row\? set /trainer/data/header to false' "$T/err" "a data row read as the header: said, with the fix"
printf 'f1,f2,label,f3,f4\n1,2,0,3,4\n' | gzip > "$T/bad.csv"
"$DTRAIN" validate "$T/bad.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a gzip-compressed csv: exit 2"
expect_grep 'bad.csv: it is gzip-compressed: gunzip it first' "$T/err" "a gzip-compressed csv: said"
{ echo f1,f2,label,f3,f4; echo 3.4028235e+38,2,0,3,4; head -100 "$T/train.csv" | tail -99; } > "$T/bad.csv"
"$DTRAIN" validate "$T/bad.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "float32's largest as numpy prints it is in range"
# Rows of another width, a label that is no class index, a header the spec does not say: each
# with its fix.
csv_refused 'f1,f2,label,f3,f4\n1,2,0,3,4\n1,2,0,3\n' "bad.csv:3: has 4 columns, expected 5 \(as the header\); fix or drop the row" "a short row"
csv_refused 'f1,f2,label,f3,f4\n1,2,0.5,3,4\n' 'bad.csv:2: label 0.5 is not a class index in 0..2 \(the model.s output width\); labels are class indices \(0, 1, ...\): fix it, or use /trainer/model/loss "mse"' "a fractional label"
# A string of digits is a header name where a column bears it; a JSON number is an index
# (before, "4" indexed column 4 even with a column named "4", training on the wrong labels).
{ echo f1,4,f2,f3,f4; for i in $(seq 80); do echo "1,$((i % 3)),2,3,7"; done; } > "$T/bad.csv"
sed 's|"label_column": "label"|"label_column": "4"|' "$T/bad.json" > "$T/digitname.json"
"$DTRAIN" validate "$T/digitname.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "label_column \"4\" names the column \"4\""
sed 's|"label_column": "label"|"label_column": 4|' "$T/bad.json" > "$T/digitindex.json"
"$DTRAIN" validate "$T/digitindex.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "label_column 4 is column 4"
expect_grep 'bad.csv:2: label 7 is not a class index' "$T/err" "label_column 4: column 4's labels read"
printf 'f1,f2,label,f3,f4\n1,2,0,3,4\n' > "$T/bad.csv"
sed 's|"label_column": "label"|"label_column": "2", "header": false|' "$T/bad.json" > "$T/nohdr.json"
"$DTRAIN" validate "$T/nohdr.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a header the spec does not say: exit 2"
expect_grep 'bad.csv:1: column 0 .* is not a number \("f1"\); if this line is a header, set /trainer/data/header to true$' "$T/err" "a header the spec does not say: said, with the fix"
# inf, nan and numbers beyond float's range would turn every weight into NaN and still "succeed".
for v in inf nan 1e400; do
  printf 'f1,f2,label,f3,f4\n1,2,0,3,4\n1,%s,1,3,4\n' "$v" > "$T/bad.csv"
  "$DTRAIN" validate "$T/bad.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "csv value $v exits 2"
  expect_grep "bad.csv:3: column 1 \(0-based\) is not a finite number within float's range \(\"$v\"\)" "$T/err" "csv value $v named"
done
# Files dtrain does not read, said with the fix: another separator, quoted cells, a NUL in the
# header (shown escaped, the message whole), gzip-compressed idx files, mse on more than one
# output of file data.
printf 'f1;f2;label;f3;f4\n1;2;0;3;4\n' > "$T/bad.csv"
"$DTRAIN" validate "$T/bad.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "semicolons: exit 2"
expect_grep "no column named \"label\" in the header .*; the line has ';' and no commas: dtrain reads comma-separated values, so convert the file" "$T/err" "semicolons: said"
csv_refused 'f1\tf2\tlabel\tf3\tf4\n1\t2\t0\t3\t4\n' "the line has tabs and no commas" "tabs"
expect_grep '\(it has "f1\\tf2\\tlabel\\tf3\\tf4"\)' "$T/err" "tabs: shown as \\t"
csv_refused 'f1,f2,label,f3,f4\n"1",2,0,3,4\n' 'is not a number \("\\"1\\""\)|is not a number \(""1""\); quoted cells are not read: remove the quotes$' "quoted cell"
csv_refused 'f1,f2,lab\0el,f3,f4\n1,2,0,3,4\n' 'it has "f1", "f2", "lab\\x00el", "f3", "f4"\); set /trainer/data/label_column to one of them' "NUL in the header"
# A NUL inside a cell (strtod stopped there: "1\0zz" read as 1), two columns of the label's
# name (the last one was taken, the first trained on as a feature), CR-only line ends.
csv_refused 'f1,f2,label,f3,f4\n1\0zz,2,0,3,4\n' 'bad.csv:2: column 0 \(0-based, as /trainer/data/label_column counts\) is not a number \("1\\x00zz"\); every cell must be' "NUL in a cell"
csv_refused 'f1,label,f3,f4,label\n1,2,0,3,1\n' 'bad.csv:1: two columns are named "label" \(columns 1 and 4, 0-based\): which is the label is not clear; rename one' "two label columns"
csv_refused 'f1,f2,label,f3,f4\r1,2,0,3,4\r' "bad.csv:1: the lines end with a carriage return alone \(CR, not LF or CRLF\): convert the file" "CR line ends"
sed 's|"layers": \[4, 32, 3\]|"layers": [4, 32, 3], "loss": "mse"|' "$T/csv.json" > "$T/mse3.json"
"$DTRAIN" validate "$T/mse3.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "mse with 3 outputs on csv: exit 2"
expect_grep "^dtrain: error: .*mse3.json: /trainer/model/layers: ends with 3 outputs, but csv data has one target column: mse regression needs an output width of 1" "$T/err" "mse with 3 outputs: the field and the fix"
sed 's|"layers": \[4, 32, 3\]|"layers": [5, 32, 3]|' "$T/csv.json" > "$T/wide.json"
"$DTRAIN" validate "$T/wide.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "feature count mismatch exits 2"
expect_grep "has 4 feature columns but /trainer/model/layers starts with 5" "$T/err" "feature count mismatch explained"
# Spreadsheet exports: a byte order mark and spaces after the commas read as the plain file.
python3 - "$T" <<'PY'
import sys
t = sys.argv[1]
rows = open(f"{t}/train.csv").read().splitlines()
with open(f"{t}/excel.csv", "w", encoding="utf-8-sig") as f:
    f.write("\n".join(", ".join(r.split(",")) for r in rows) + "\n")
PY
sed "s|train.csv|excel.csv|" "$T/csv.json" > "$T/excel.json"
"$DTRAIN" validate "$T/excel.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "csv with a BOM and spaces after commas is read"
# A label column that is not there: the header's names listed; a huge index is no crash.
sed 's|"label_column": "label"|"label_column": "target"|' "$T/csv.json" > "$T/lc.json"
"$DTRAIN" validate "$T/lc.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "unknown label column exits 2"
expect_grep 'no column named "target" in the header \(it has "f1", "f2", "label", "f3", "f4"\)' "$T/err" "unknown label column: the names found listed"
sed 's|"label_column": "label"|"label_column": "99999999999", "header": false|' "$T/csv.json" > "$T/lc2.json"
"$DTRAIN" validate "$T/lc2.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "huge label column index exits 2"
expect_grep "label column 99999999999 does not exist \(5 columns\); set /trainer/data/label_column" "$T/err" "huge label column index explained"
sed 's|"layers": \[64, 32, 4\]|"layers": [64, 32, 3]|' "$T/idx.json" > "$T/cls.json"
"$DTRAIN" run "$T/cls.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "label out of range exits 2"
expect_grep "is not a class index in 0..2 \(the model's output width\); fix it, or, with 4 classes or more, make the last of /trainer/model/layers 4$" "$T/err" "label range explained, with the fix"
# A corrupt count in the idx headers (4 billion images): "truncated", not terabytes allocated.
python3 - "$T" <<'PY'
import sys
t = sys.argv[1]
for src, dst in (("train-images.idx3-ubyte", "huge-images.idx3-ubyte"), ("train-labels.idx1-ubyte", "huge-labels.idx1-ubyte")):
    b = bytearray(open(f"{t}/{src}", "rb").read())
    b[4:8] = (0xFFFFFFF0).to_bytes(4, "big")
    open(f"{t}/{dst}", "wb").write(b)
PY
sed 's|train-images|huge-images|; s|train-labels|huge-labels|' "$T/idx.json" > "$T/huge.json"
(ulimit -v 4000000; timeout 60 "$DTRAIN" run "$T/huge.json" >"$T/out" 2>"$T/err"); expect_eq "$?" 2 "idx with a corrupt count exits 2"
expect_grep "huge-images.idx3-ubyte: truncated: the header says 4294967280 images, the file holds 2000" "$T/err" "corrupt count explained"
# Bytes past the header's count (two files joined): said, not cut silently.
{ cat "$T/train-images.idx3-ubyte"; head -c 64 /dev/zero; } >"$T/long-images.idx3-ubyte"
sed "s|$T/train-images.idx3-ubyte|$T/long-images.idx3-ubyte|" "$T/idx.json" >"$T/long.json"
"$DTRAIN" validate "$T/long.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "an idx file longer than its count exits 2"
expect_grep "long-images.idx3-ubyte: the header says [0-9]+ images, but the file holds more bytes after them; make the header's count match the file" "$T/err" "an idx file longer than its count: said"
# Well-formed idx files of no images (as eval files): refused as a csv of no rows is, not
# taken and then dropped from the launcher's shared data image as "malformed".
printf '\x00\x00\x08\x03\x00\x00\x00\x00\x00\x00\x00\x08\x00\x00\x00\x08' >"$T/zero-images.idx3-ubyte"
printf '\x00\x00\x08\x01\x00\x00\x00\x00' >"$T/zero-labels.idx1-ubyte"
sed "s|t10k-images|zero-images|; s|t10k-labels|zero-labels|" "$T/idx.json" >"$T/zero.json"
"$DTRAIN" run "$T/zero.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "idx files of no images exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: $T/zero-images.idx3-ubyte: no images (the header's count is 0)" "idx files of no images: said, one line"
# A file shorter than an idx header: said so, not "magic 0x00000000".
printf '\x00\x00' >"$T/tiny.idx3-ubyte"
sed "s|$T/train-images.idx3-ubyte|$T/tiny.idx3-ubyte|" "$T/idx.json" >"$T/tiny.json"
"$DTRAIN" validate "$T/tiny.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a 2-byte idx file exits 2"
expect_grep "tiny.idx3-ubyte: 2 bytes, too short for an idx3-ubyte images file \(its header alone is 16 bytes\)" "$T/err" "a 2-byte idx file: too short"
# MNIST as downloaded: gzip-compressed.
gzip -c "$T/train-images.idx3-ubyte" >"$T/gz-images.idx3-ubyte.gz"
sed "s|$T/train-images.idx3-ubyte|$T/gz-images.idx3-ubyte.gz|" "$T/idx.json" >"$T/gz.json"
"$DTRAIN" validate "$T/gz.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a gzipped idx file exits 2"
expect_grep "gz-images.idx3-ubyte.gz: not an idx3-ubyte images file \(magic 0x1f8b[0-9a-f]{4}, expected 0x00000803\); it is gzip-compressed: gunzip it first$" "$T/err" "a gzipped idx file: gunzip it"
sed 's|t10k-labels|nope-labels|' "$T/idx.json" > "$T/missing.json"
"$DTRAIN" run "$T/missing.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "missing file exits 2"
expect_grep "/trainer/data/eval_labels_path: file \".*nope-labels.idx1-ubyte\" does not exist" "$T/err" "missing file named"
# A data file changed while the job runs (here touched: its times) is read again at the
# restart: the launcher makes the image again, rather than each restarted worker parsing the
# files on top of the stale one.
cp "$T/train.csv" "$T/live.csv"
cat > "$T/live.json" <<JSON
{"nproc_per_node": 2, "max_restarts": 1, "restart_backoff_s": 0.1,
 "trainer": {"model": {"layers": [4, 32, 3]}, "data": {"type": "csv", "path": "$T/live.csv", "label_column": "label"},
  "batch_size": 32, "epochs": 400, "optimizer": {"lr": 0.05, "momentum": 0.9}, "log_every_steps": 100000,
  "checkpoint": {"dir": "$T/live-ckpt", "every_steps": 50}}}
JSON
"$DTRAIN" run "$T/live.json" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 600); do ls "$T/live-ckpt" 2>/dev/null | grep -q "^ckpt-" && break; sleep 0.1; done
touch "$T/live.csv"
victim=$(pgrep -P "$DTRAIN_PID" -f " train " | tail -1)
[ -n "$victim" ] && kill -9 "$victim"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 0 "a data file changed, then a restart: the job completes"
expect_grep "^dtrain: restart 1: $T/live.csv changed since the data image was made; made it again from the file as it is now \([0-9]+ KiB\)$" "$T/err" "the changed file: the image made again"
expect_eq "$(grep -c "^\\[rank 0\\] trainer: data mapped from this host's data image" "$T/out")" 2 "both attempts' workers map an image"
expect_no_grep "parsed from the files" "$T/out" "no restarted worker parses the files itself"
# A data file that is a pipe is read once, by the launcher: a local job's workers get it
# through the data image; where they would each read it again (DTRAIN_DATA_SHARE=0, several
# hosts) the job is refused at once (exit 2), rather than workers waiting for rows for good,
# and before the launcher reads it.
head -200 "$T/train.csv" > "$T/small.csv"
mkfifo "$T/data.fifo"
cat > "$T/fifo.json" <<JSON
{"nproc_per_node": 2, "trainer": {"model": {"layers": [4, 8, 3]}, "data": {"type": "csv", "path": "$T/data.fifo", "label_column": "label"},
  "batch_size": 4, "epochs": 1, "log_every_steps": 1000}}
JSON
(cat "$T/small.csv" > "$T/data.fifo" &)
timeout 60 "$DTRAIN" run "$T/fifo.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "a pipe as the data file: the workers map the launcher's read"
expect_grep "^\[rank 0\] trainer: data mapped from this host's data image" "$T/out" "a pipe as the data file: through the image"
# (no one writing the pipe: the refusal comes before any read, which would wait for a writer)
for how in share0 hosts; do
  if [ $how = share0 ]; then DTRAIN_DATA_SHARE=0 timeout 20 "$DTRAIN" run "$T/fifo.json" >"$T/out" 2>"$T/err"
  else timeout 20 "$DTRAIN" run "$T/fifo.json" --hosts localhost:1,127.0.0.1:1 >"$T/out" 2>"$T/err"; fi
  expect_eq "$?" 2 "a pipe as the data file, $how: exit 2"
  expect_grep "^dtrain: error: $T/fifo.json: /trainer/data/path: \"$T/data.fifo\" is not a regular file \(a pipe\?\) and can be read only once, and .*; give a regular file$" "$T/err" "a pipe as the data file, $how: refused, naming it"
done
finish
