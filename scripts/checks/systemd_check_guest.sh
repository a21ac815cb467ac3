#!/usr/bin/env bash
# The inside of scripts/checks/systemd_check.sh: runs as root in the booted container. Installs the
# project with the commands of systemd/README.md (sections 1-4, 6), then checks each promise
# and prints one PASS/FAIL/SKIP line for it. Progress goes to stderr, results to stdout.
set -u
export SYSTEMD_PAGER= SYSTEMD_COLORS=0 DEBIAN_FRONTEND=noninteractive
V=/opt/dflash-loader/.venv/bin
SOCK=/run/dflash-loader/loader.sock
JOB=tiny
RUN=/var/lib/dflash-trainer/$JOB
W=/root/check

say() { echo "[check] $*" >&2; }
result() { echo "$1 $2${3:+: $3}"; }
# check NAME DETAIL COMMAND...: PASS if the command succeeds.
check() {
    local name=$1 detail=$2
    shift 2
    if "$@" >>$W/commands.log 2>&1; then result PASS "$name" "$detail"; else result FAIL "$name" "$detail (failed: $*)"; fi
}
# wait_for SECONDS COMMAND...: poll every 0.2 s until the command succeeds.
wait_for() {
    local end=$((SECONDS + $1))
    shift
    while ! "$@" >/dev/null 2>&1; do
        [ $SECONDS -ge $end ] && return 1
        sleep 0.2
    done
}
prop() { systemctl show -p "$2" --value "$1"; }
as_trainer() { runuser -u dflash-train -- "$@"; }
n_sessions() { as_trainer $V/dflash-loader stats --json | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["sessions"]))'; }
metrics_lines() { wc -l <"$1/metrics.jsonl" 2>/dev/null || echo 0; }
run_guide() { say "guide: $*"; "$@" >>$W/install.log 2>&1; }

# --- 1. users and groups (verbatim) ----------------------------------------------------------
run_guide sudo useradd --system --user-group --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin dflash
run_guide sudo useradd --system --user-group --groups dflash --no-create-home \
    --home-dir /var/lib/dflash-trainer --shell /usr/sbin/nologin dflash-train

# --- 2. paths and the virtualenv -----------------------------------------------------------
ok=1
run_guide sudo apt-get install -y git python3-venv python3-dev gcc || ok=0
run_guide sudo git clone $W/repo.bundle /opt/dflash-loader || ok=0
run_guide sudo python3 -m venv /opt/dflash-loader/.venv || ok=0
run_guide sudo $V/pip install '/opt/dflash-loader[daemon]' || ok=0
if [ $ok = 1 ]; then
    result PASS "install [daemon]" "$(du -sm /opt/dflash-loader/.venv | cut -f1) MB venv"
else
    result FAIL "install [daemon]" "see the pip output in the container's $W/install.log"
    exit 1
fi
run_guide $V/dflash-loader --help
# The dataset: a small synthetic corpus (token ids < 512, the tiny target's vocabulary) at
# the path loader.toml names, readable by the dflash group as section 2 asks. Made before
# torch is installed: the daemon host's commands must not need it.
run_guide sudo mkdir -p /data
if $V/python -c 'import torch' 2>/dev/null; then
    result FAIL "daemon host without torch" "torch got installed by [daemon]"
else
    check "daemon host without torch" "torch absent; dflash-loader --help and synth run" \
        sudo $V/dflash-loader synth /data/corpus --samples 3000 --content learnable \
        --vocab-size 512 --median-len 96 --max-len 256
fi
run_guide sudo chgrp -R dflash /data/corpus
run_guide sudo chmod -R g+rX /data/corpus
wheel=$(ls $W/torch-*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ]; then
    # The guide's "install the build you want first", from a local copy of the CPU wheel.
    run_guide sudo $V/pip install "$wheel" || ok=0
else
    run_guide sudo $V/pip install torch --index-url https://download.pytorch.org/whl/cpu || ok=0
fi
run_guide sudo $V/pip install '/opt/dflash-loader[daemon,train]' || ok=0
if [ $ok = 1 ] && $V/python -c 'import torch, transformers' 2>>$W/install.log; then
    result PASS "install [daemon,train]" "torch $($V/python -c 'import torch; print(torch.__version__)')${wheel:+ (local wheel)}"
else
    result FAIL "install [daemon,train]" "see $W/install.log"
    exit 1
fi

# --- 3. config -------------------------------------------------------------------------------
run_guide sudo install -d -m 0755 /etc/dflash-loader
run_guide sudo install -m 0644 /opt/dflash-loader/systemd/loader.toml /etc/dflash-loader/loader.toml

# --- 4. install, enable, start ---------------------------------------------------------------
run_guide sudo install -m 0644 /opt/dflash-loader/systemd/dflash-loader.service \
    /opt/dflash-loader/systemd/dflash-trainer@.service /etc/systemd/system/
out=$(sudo systemd-analyze verify /etc/systemd/system/dflash-loader.service 2>&1)
if [ -z "$out" ]; then result PASS "systemd-analyze verify" "dflash-loader.service clean"; else result FAIL "systemd-analyze verify" "$out"; fi
run_guide sudo systemctl daemon-reload
t0=$(date +%s.%N)
if sudo systemctl enable --now dflash-loader >>$W/commands.log 2>&1; then
    t1=$(date +%s.%N)
    # Type=notify: start returned only after READY=1, so the socket answers right now.
    if [ "$(prop dflash-loader Type)" = notify ] && [ "$(prop dflash-loader ActiveState)" = active ] &&
        as_trainer $V/dflash-loader stats >/dev/null 2>>$W/commands.log; then
        result PASS "notify readiness" "Type=notify, start returned after $(python3 -c "print(f'{$t1 - $t0:.1f}')") s and stats answered at once"
    else
        result FAIL "notify readiness" "active=$(prop dflash-loader ActiveState), stats: $(as_trainer $V/dflash-loader stats 2>&1 | tail -1)"
    fi
else
    result FAIL "notify readiness" "systemctl enable --now failed: $(journalctl -u dflash-loader -n 5 --no-pager)"
    exit 1
fi

# --- 5. watching it --------------------------------------------------------------------------
status=$(prop dflash-loader StatusText)
case "$status" in
    "serving: "*) result PASS "Status" "\"$status\"" ;;
    *) result FAIL "Status" "\"$status\"" ;;
esac
check "guide commands (section 5)" "systemctl status, journalctl -u/-b -p warning, stats as a member" \
    bash -c "systemctl status dflash-loader --no-pager >/dev/null; [ \$? -le 3 ] &&
        journalctl -u dflash-loader -n 5 --no-pager && journalctl -u dflash-loader -b -p warning --no-pager &&
        runuser -u dflash-train -- $V/dflash-loader stats"

# --- 7. permissions --------------------------------------------------------------------------
modes="$(stat -c '%a %U:%G' /run/dflash-loader) / $(stat -c '%a %U:%G' $SOCK)"
if [ "$modes" = "750 dflash:dflash / 660 dflash:dflash" ]; then
    result PASS "socket permissions" "$modes (folder / socket)"
else
    result FAIL "socket permissions" "$modes, guide says 750 dflash:dflash / 660 dflash:dflash"
fi
check "socket: a member connects" "dflash-train runs stats" as_trainer $V/dflash-loader stats
denied=$(runuser -u nobody -- $V/dflash-loader stats 2>&1)
case "$denied" in
    *"permission denied connecting to $SOCK"*) result PASS "socket: a non-member is refused" "$(echo "$denied" | tail -1)" ;;
    *) result FAIL "socket: a non-member is refused" "$(echo "$denied" | tail -1)" ;;
esac

# A reader that keeps a session open across the daemon's restarts (as a trainer would).
cat >$W/reader.py <<'EOF'
import sys, time
from client import LoaderClient
c = LoaderClient("ipc:///run/dflash-loader/loader.sock", job="probe", rank=0, world_size=1,
                 timeout_s=120)
with open(sys.argv[1], "w", buffering=1) as f:
    for b in c:
        f.write(f"{time.time():.3f} {b.epoch} {b.step} {b.micro}\n")
        time.sleep(0.02)
EOF
chmod 644 $W/reader.py
chmod 755 $W /root
as_trainer bash -c "cd /tmp && $V/python $W/reader.py /tmp/reader.log" 2>$W/reader.err &
READER=$!
wait_for 60 test -s /tmp/reader.log || result FAIL "reader" "no batches: $(tail -3 $W/reader.err)"

# --- watchdog: a wedged daemon (SIGSTOP) is killed and restarted ------------------------------
pid0=$(prop dflash-loader MainPID)
n0=$(prop dflash-loader NRestarts)
t0=$SECONDS
kill -STOP "$pid0"
if wait_for 90 bash -c "[ \"\$(systemctl show -p NRestarts --value dflash-loader)\" -gt $n0 ] && systemctl is-active -q dflash-loader"; then
    if journalctl -u dflash-loader --no-pager | grep -q "Watchdog timeout"; then
        result PASS "watchdog restart" "SIGSTOP'd daemon replaced after $((SECONDS - t0)) s (journal: Watchdog timeout)"
    else
        result FAIL "watchdog restart" "restarted, but no 'Watchdog timeout' in the journal"
    fi
else
    result FAIL "watchdog restart" "no restart within 90 s (NRestarts=$(prop dflash-loader NRestarts))"
fi

# --- kill -9: Restart=on-failure, the reader reconnects -------------------------------------
pid1=$(prop dflash-loader MainPID)
before=$(wc -l </tmp/reader.log)
tkill=$(date +%s.%N)
kill -KILL "$pid1"
if wait_for 60 bash -c "[ \"\$(systemctl show -p MainPID --value dflash-loader)\" != $pid1 ] && systemctl is-active -q dflash-loader" &&
    wait_for 60 bash -c "[ \$(wc -l </tmp/reader.log) -gt $((before + 20)) ]"; then
    gap=$(python3 - "$tkill" <<'EOF'
import sys
kill = float(sys.argv[1])
rows = [l.split() for l in open("/tmp/reader.log")]
times = [float(r[0]) for r in rows]
pos = [tuple(map(int, r[1:])) for r in rows]
after = [t for t in times if t > kill]
ordered = all(a < b for a, b in zip(pos, pos[1:]))
# The ring held up to `slots` (4) batches made before the kill: the 5th one after it had to
# come from the restarted daemon, over a new session.
print(f"{after[4] - kill:.1f} {'ordered' if ordered else 'DISORDER'}")
EOF
)
    case "$gap" in
        *ordered) result PASS "restart after kill -9, client back" "first batch from the new daemon $(echo $gap | cut -d' ' -f1) s after the kill, positions continue without gap or repeat" ;;
        *) result FAIL "restart after kill -9, client back" "$gap" ;;
    esac
else
    result FAIL "restart after kill -9, client back" "daemon or reader did not come back: $(tail -2 $W/reader.err)"
fi
# Rings of the killed daemon: named after its pid, removed by the next start.
left=$(ls /dev/shm | grep -c -- "-$pid1-" || true)
if [ "$left" = 0 ]; then
    result PASS "no manual ring clean-up" "the restarted daemon removed the killed one's rings"
else
    result FAIL "no manual ring clean-up" "$left ring file(s) of pid $pid1 left in /dev/shm"
fi

# --- clean stop with a session open: no rings left -------------------------------------------
rings_before=$(ls /dev/shm | grep -c '^dflash-' || true)
sudo systemctl stop dflash-loader
rings_after=$(ls /dev/shm | grep -c '^dflash-' || true)
state="$(prop dflash-loader ActiveState)/$(prop dflash-loader Result)"
if [ "$rings_before" -gt 0 ] && [ "$rings_after" = 0 ] && [ "$state" = inactive/success ]; then
    result PASS "clean stop" "$state, $rings_before ring file(s) before, none after"
else
    result FAIL "clean stop" "$state, rings before $rings_before, after $rings_after"
fi
kill $READER 2>/dev/null
pkill -u dflash-train -f reader.py 2>/dev/null
sudo systemctl start dflash-loader

# --- a dataset under /home: one clear line, Status says why ---------------------------------
sudo cp -a /data/corpus /home/corpus
sudo mkdir -p /etc/systemd/system/dflash-loader.service.d
printf '[Service]\nExecStart=\nExecStart=%s/dflash-loader serve --config /etc/dflash-loader/loader.toml --dataset /home/corpus\n' "$V" |
    sudo tee /etc/systemd/system/dflash-loader.service.d/home.conf >/dev/null
sudo systemctl daemon-reload
sudo systemctl restart dflash-loader 2>/dev/null
status=$(prop dflash-loader StatusText)
line=$(journalctl -u dflash-loader -n 30 --no-pager -o cat | grep '^Error:' | tail -1)
sudo rm /etc/systemd/system/dflash-loader.service.d/home.conf
sudo systemctl daemon-reload
case "$line" in
    *"/home/corpus: permission denied"*"ProtectHome=yes"*) result PASS "dataset under /home" "$line" ;;
    *) result FAIL "dataset under /home" "journal: ${line:-$(journalctl -u dflash-loader -n 3 --no-pager -o cat)}" ;;
esac
case "$status" in
    "failed to start: "*) result PASS "Status after a failed start" "\"$status\"" ;;
    *) result FAIL "Status after a failed start" "\"$status\"" ;;
esac
if journalctl -u dflash-loader -n 40 --no-pager -o cat | grep -q Traceback; then
    result FAIL "dataset under /home" "a traceback in the journal"
fi
sudo systemctl reset-failed dflash-loader
sudo systemctl start dflash-loader
wait_for 30 systemctl is-active -q dflash-loader

# --- 6. trainer jobs -----------------------------------------------------------------------------
run_guide sudo install -m 0640 -g dflash-train /opt/dflash-loader/systemd/trainer.env.example \
    /etc/dflash-loader/trainer-$JOB.env
# The edit the guide asks for (sudoedit): 2 CPU ranks, the tiny target, small batches.
TRAIN="--target tiny --steps 100000 --ckpt-every 5 --token-budget 1024 --max-seq-len 256 --block-size 8 --anchors-per-doc 16 --num-eval-prompts 0 --no-progress"
sudo sed -i -e 's/^NPROC=.*/NPROC=2/' -e "s|^TRAIN_ARGS=.*|TRAIN_ARGS=$TRAIN|" /etc/dflash-loader/trainer-$JOB.env
sudo systemctl start dflash-trainer@$JOB
if wait_for 240 bash -c "ls $RUN/checkpoints/ 2>/dev/null | grep -q '^step-'"; then
    result PASS "trainer unit runs and checkpoints" "$(ls $RUN/checkpoints | tail -1) in $RUN as $(stat -c %U $RUN)"
else
    result FAIL "trainer unit runs and checkpoints" "$(journalctl -u dflash-trainer@$JOB -n 8 --no-pager -o cat)"
fi

# kill -9 of a rank: the job fails, systemd restarts it, it resumes from its checkpoint.
main=$(prop dflash-trainer@$JOB MainPID)
rank=$(pgrep -P "$main" | head -1)
n0=$(prop dflash-trainer@$JOB NRestarts)
t0=$SECONDS
if [ -n "$rank" ] && kill -KILL "$rank"; then
    if wait_for 300 bash -c "journalctl -u dflash-trainer@$JOB --no-pager -o cat | grep -q 'resumed from $RUN/checkpoints/step-'"; then
        step=$(journalctl -u dflash-trainer@$JOB --no-pager -o cat | grep -o "resumed from $RUN/checkpoints/step-[0-9]*" | tail -1)
        result PASS "kill -9 of a rank resumes" "NRestarts $n0 -> $(prop dflash-trainer@$JOB NRestarts), ${step##*/} after $((SECONDS - t0)) s (RestartSec=30)"
    else
        result FAIL "kill -9 of a rank resumes" "$(journalctl -u dflash-trainer@$JOB -n 8 --no-pager -o cat)"
    fi
else
    result FAIL "kill -9 of a rank resumes" "no rank process under $main"
fi

# The loader restarts under a running trainer: the trainer keeps its process and keeps going.
wait_for 120 bash -c "[ \$(wc -l <$RUN/metrics.jsonl) -gt 0 ]"
main=$(prop dflash-trainer@$JOB MainPID)
sudo systemctl restart dflash-loader
lines=$(metrics_lines $RUN)
if wait_for 120 bash -c "[ \$(wc -l <$RUN/metrics.jsonl) -gt $((lines + 3)) ]" &&
    [ "$(prop dflash-trainer@$JOB MainPID)" = "$main" ]; then
    result PASS "loader restart under a running trainer" "same trainer pid $main, $(($(metrics_lines $RUN) - lines)) more steps after the restart"
else
    result FAIL "loader restart under a running trainer" "$(journalctl -u dflash-trainer@$JOB -n 6 --no-pager -o cat)"
fi

# systemctl stop: inactive (dead), sessions gone at once, a checkpoint of the last step.
sudo systemctl stop dflash-trainer@$JOB
state="$(prop dflash-trainer@$JOB ActiveState)/$(prop dflash-trainer@$JOB Result)/$(prop dflash-trainer@$JOB ExecMainStatus)"
open=$(n_sessions)
last=$(python3 -c "import json; print(max(json.loads(l)['step'] for l in open('$RUN/metrics.jsonl')))")
ckpt=$(ls $RUN/checkpoints | tail -1)
if [ "$state" = inactive/success/0 ] && [ "$open" = 0 ] && [ "$ckpt" = "$(printf 'step-%08d' "$last")" ]; then
    result PASS "trainer stop ends inactive" "$state, 0 sessions when stop returned, checkpoint $ckpt = last step"
else
    result FAIL "trainer stop ends inactive" "$state, $open session(s) open, last step $last, newest checkpoint $ckpt"
fi

# Change the job's batch spec: edit the env file (new spec, new RUN_DIR), start again.
sudo sed -i -e "s|^TRAIN_ARGS=.*|TRAIN_ARGS=${TRAIN/--token-budget 1024/--token-budget 2048}|" \
    -e "s|^#RUN_DIR=.*|RUN_DIR=$RUN/budget-2048|" /etc/dflash-loader/trainer-$JOB.env
sudo systemctl start dflash-trainer@$JOB
if wait_for 240 bash -c "[ \$(wc -l <$RUN/budget-2048/metrics.jsonl 2>/dev/null || echo 0) -gt 2 ]"; then
    budget=$(python3 -c "import json; print(json.load(open('$RUN/budget-2048/loader_spec.json'))['token_budget'])")
    result PASS "spec change and restart" "job $JOB serves token_budget $budget in its new RUN_DIR, NRestarts $(prop dflash-trainer@$JOB NRestarts)"
else
    result FAIL "spec change and restart" "$(journalctl -u dflash-trainer@$JOB -n 8 --no-pager -o cat)"
fi
sudo systemctl stop dflash-trainer@$JOB
check "trainer stop ends inactive (again)" "$(prop dflash-trainer@$JOB ActiveState)/$(prop dflash-trainer@$JOB Result)" \
    test "$(prop dflash-trainer@$JOB ActiveState)/$(prop dflash-trainer@$JOB Result)" = inactive/success

# --- devices ---------------------------------------------------------------------------------
if ls /dev/nvidia0 >/dev/null 2>&1; then
    result FAIL "GPU visible to the trainer unit" "not checked by this script yet"
else
    result SKIP "GPU visible to the trainer unit" "no NVIDIA GPU in this container; DeviceAllow= is $(prop dflash-trainer@$JOB DeviceAllow | tr '\n' ' ')"
fi
result SKIP "multi-node (section 8)" "needs several machines"

# --- hardening scores -------------------------------------------------------------------------
for unit in dflash-loader.service dflash-trainer@$JOB.service; do
    score=$(systemd-analyze security --no-pager "$unit" 2>&1 | tail -1 | sed 's/.*: //')
    value=${score%% *}
    if python3 -c "import sys; sys.exit(0 if float('$value') <= 4.0 else 1)" 2>/dev/null; then
        result PASS "systemd-analyze security $unit" "$score (at most 4.0 expected)"
    else
        result FAIL "systemd-analyze security $unit" "$score (at most 4.0 expected)"
    fi
done
