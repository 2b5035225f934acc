"""The job the slurm launcher submits: ``OUT/slurm/primerl.sbatch`` and one script per role.

One batch script, one job, every role an ``srun`` step inside it (the reasons are in
``launcher.py``'s docstring). The job's nodes, in the order Slurm lists them:

    [orchestrator node, if launcher.orchestrator_node] [inference nodes] [trainer nodes]

With one node every role is on it. The batch script runs on the job's first node and:

1. lists the nodes (``scontrol show hostnames``) and places the roles on them;
2. picks the inference servers' ports (fixed ``inference.port + i`` on nodes of their own;
   on a one-node job, free ones, as the local launcher does);
3. starts the steps, all ``srun --overlap`` (steps on a shared node share its CPUs): the
   Mooncake master on the first node when ``inference.kv_store = "mooncake"`` (first, and
   waited for: it prints the addresses the servers need); then it writes what the job
   discovered into the run-time record ``OUT/runtime.json`` (:mod:`primerl.runtime`: the
   servers' URLs, each pool's with prefill/decode, and the KV store's options — the
   master's addresses, or the job's shared ``disk`` folder), which every process reads
   beside ``OUT/config.toml`` (the orchestrator spreads requests over the servers, the
   trainer sends NCCL weights to them), and starts the
   inference servers (spread evenly; ``primerl inference`` each, with its port and, with
   prefill/decode, its ``inference.role``), the orchestrator (its env workers are its
   children), and the trainer (torchrun on every trainer node, a c10d rendezvous on the
   first);
4. follows them as the local launcher follows its children: the job succeeds when the
   trainer finishes its last step; the trainer or orchestrator failing, or every inference
   server exiting, fails it (a server that exits while another serves is started again by
   its own task: ``RESTARTING_SERVER``). The cause goes to ``OUT/slurm/job-<id>.status``
   (``rc``, ``role``, ``message``), the others get SIGTERM and the script exits with the
   failing role's code, which becomes the job's.

Logs: ``OUT/logs/slurm-<id>.out`` (the batch script), ``inference.log`` (or
``inference-<i>.log`` per server), ``orchestrator.log``, ``trainer.log`` (or
``trainer-<node>.log`` per trainer node), ``mooncake.log``.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import attrs

from primerl.config import RunConfig
from primerl.rundir import RunDir

GRACE_SECONDS = 10
POLL_SECONDS = 2
BATCH = "primerl.sbatch"
ROLES = ("mooncake", "inference", "orchestrator", "trainer")


@attrs.frozen
class Layout:
    """Which of the job's nodes run what."""

    nodes: int
    inference_nodes: int
    trainer_nodes: int
    orchestrator_node: bool
    servers: int  # inference servers in all
    per_node: int  # inference servers on each inference node
    # each server's inference.role, in order: "prefill"s then "decode"s with prefill/decode
    # disaggregation, else "both"
    roles: tuple[str, ...] = ()

    @property
    def prefill(self) -> int:
        return self.roles.count("prefill")

    @property
    def shared(self) -> bool:
        return self.nodes == 1

    @property
    def inference_first(self) -> int:
        return 0 if self.shared else int(self.orchestrator_node)

    @property
    def trainer_first(self) -> int:
        return 0 if self.shared else self.inference_first + self.inference_nodes

    def describe(self, cfg: RunConfig) -> str:
        nproc = cfg.trainer.nproc
        if self.shared:
            return (f"1 node: {self.servers} inference server(s), the orchestrator and the trainer "
                    f"({nproc} rank(s)) share it")
        orch = "its own node" if self.orchestrator_node else "the first inference node"
        return (f"{self.nodes} nodes: {self.inference_nodes} inference ({self.servers} server(s), {self.per_node} "
                f"a node), {self.trainer_nodes} trainer ({self.trainer_nodes} x {nproc} = "
                f"{self.trainer_nodes * nproc} ranks), the orchestrator on {orch}")


def _dq(text: str) -> str:
    """``text`` escaped for a bash double-quoted string."""
    return "".join("\\" + c if c in '\\"$`' else c for c in text)


def layout(cfg: RunConfig) -> Layout:
    """The placement ``cfg`` asks for; ``ValueError`` names the keys of one that cannot be."""
    lc, inf = cfg.launcher, cfg.inference
    if inf.disaggregated():  # prefill/decode: the two pools replace replicas
        roles = ("prefill",) * inf.prefill_replicas + ("decode",) * inf.decode_replicas
        keys = f"inference.prefill_replicas + decode_replicas ({inf.prefill_replicas} + {inf.decode_replicas})"
    else:
        n = lc.inference_nodes if inf.replicas == 1 and lc.nodes > 1 else inf.replicas  # default: one a node
        roles = ("both",) * n
        keys = f"inference.replicas ({inf.replicas})"
    servers = len(roles)
    if lc.nodes == 1:
        return Layout(1, 1, 1, False, servers, servers, roles)
    if servers % lc.inference_nodes:
        raise ValueError(f"{keys} must be a multiple of launcher.inference_nodes ({lc.inference_nodes}): servers "
                         f"are spread evenly over the inference nodes")
    return Layout(lc.nodes, lc.inference_nodes, lc.trainer_nodes, lc.orchestrator_node, servers,
                  servers // lc.inference_nodes, roles)


def _q(value: object) -> str:
    return shlex.quote(str(value))


def sbatch_header(cfg: RunConfig, run_dir: RunDir, cwd: Path) -> list[str]:
    lc = cfg.launcher
    lines = [f"--job-name={lc.job_name}", f"--nodes={lc.nodes}", "--ntasks-per-node=1"]
    if lc.exclusive:
        lines.append("--exclusive")
    if lc.gpus_per_node:
        lines.append(f"--gpus-per-node={lc.gpus_per_node}")
    for key, opt in (("partition", "--partition"), ("account", "--account"), ("time_limit", "--time")):
        if getattr(lc, key):
            lines.append(f"{opt}={getattr(lc, key)}")
    lines += [f"--output={run_dir.logs}/slurm-%j.out", f"--chdir={cwd}", *lc.sbatch_args]
    for line in lines:
        if any(c in line for c in "\n\r"):
            raise ValueError(f"an sbatch option cannot hold a line break: {line!r}")
    return [f"#SBATCH {line}" for line in lines]


def batch_script(cfg: RunConfig, run_dir: RunDir, lay: Layout, cwd: Path) -> str:
    """``OUT/slurm/primerl.sbatch``."""
    slurm = run_dir.root / "slurm"
    inf = cfg.inference
    mooncake = inf.kv_store == "mooncake"
    nl = "\n"
    if lay.shared:
        ports = f'mapfile -t PORTS < <("$JOB_PY" -m primerl_slurm.ports {_q(inf.host)} {inf.port} {lay.per_node})'
        url_host = f"[{inf.host}]" if ":" in inf.host else inf.host
        if not all(c.isalnum() or c in ".-_[]:" for c in url_host):
            raise ValueError(f"inference.host {inf.host!r} is not a host name or an IP address")
        bind = inf.host
        threads = 'BASE=${PRIMERL_THREADS:-$(( CPUS / 2 > 0 ? CPUS / 2 : 1 ))}  # three roles share the node, as locally'
    else:
        first = inf.port or 8000
        ports = f"PORTS=({' '.join(str(first + i) for i in range(lay.per_node))})"
        url_host = "${INFERENCE_HOSTS[i / " + str(lay.per_node) + "]}"
        bind = "0.0.0.0"  # reached from the orchestrator's and the trainer's nodes (an API key is required)
        threads = "BASE=${PRIMERL_THREADS:-$CPUS}  # every role has its nodes to itself"
    trainer_log = "trainer.log" if lay.trainer_nodes == 1 else "trainer-%n.log"
    pd_urls = "" if not lay.prefill else (
        f'  printf \', "prefill_urls": [%s]\' "$(join "${{URLS[@]:0:{lay.prefill}}}")"\n'
        f'  printf \', "decode_urls": [%s]\' "$(join "${{URLS[@]:{lay.prefill}}}")"\n')
    # what the KV store needs from the job (the run-time record's kv_store_options): the
    # Mooncake master it starts, or one directory every server of the job shares
    if mooncake:
        store = 'KV_OPTIONS="\\"master\\": \\"$MOONCAKE_MASTER\\", \\"metadata\\": \\"$MOONCAKE_METADATA\\""'
    elif inf.kv_store == "disk" and "root" not in inf.kv_store_options:
        folder = _dq(json.dumps(f"{run_dir.root / 'kv'}/disk-")[:-1])  # "...disk- (the job id and the quote follow)
        shared = ', \\"shared\\": true' if lay.prefill else ""
        store = f'KV_OPTIONS="\\"root\\": {folder}$SLURM_JOB_ID\\"{shared}"  # one directory every server shares'
    else:
        store = 'KV_OPTIONS=""'

    inference_log = "inference.log" if lay.servers == 1 else "inference-%t.log"
    header = sbatch_header(cfg, run_dir, cwd)
    return f"""#!/bin/bash
{nl.join(header)}
#
# A primerl run as one Slurm job, written by `primerl run --launcher slurm` (primerl_slurm;
# docs/slurm.md). {lay.describe(cfg)}.
# Submitting it again (sbatch {slurm / BATCH}) resumes the run from its newest checkpoint.
set -uo pipefail

export JOB_PY={_q(sys.executable)}
export JOB_CONFIG={_q(run_dir.config)}
RUNTIME={_q(run_dir.runtime)}
export PYTHONUNBUFFERED=1
SLURM_DIR={_q(slurm)}
LOGS={_q(run_dir.logs)}
STATUS="$SLURM_DIR/job-$SLURM_JOB_ID.status"
GRACE={GRACE_SECONDS}
declare -A PIDS=()

say() {{ echo "[$(date +%H:%M:%S)] $*"; }}

# finish RC ROLE MESSAGE: record why the job ends, stop every step, exit with RC (the job's code)
finish() {{
  local rc=$1 role=$2 pid alive _
  shift 2
  trap - TERM INT
  say "$*"
  printf 'rc=%s\\nrole=%s\\nmessage=%s\\n' "$rc" "$role" "$*" > "$STATUS.tmp" && mv -f "$STATUS.tmp" "$STATUS"
  for pid in ${{PIDS[@]+"${{PIDS[@]}}"}}; do kill -TERM "$pid" 2>/dev/null; done
  for _ in $(seq "$GRACE"); do
    alive=0
    for pid in ${{PIDS[@]+"${{PIDS[@]}}"}}; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 1
  done
  exit "$rc"  # Slurm ends whatever is left of the steps with the job
}}
trap 'finish 143 job "the job was cancelled (SIGTERM)"' TERM
trap 'finish 130 job "the job was interrupted (SIGINT)"' INT

# a requeued job continues from the newest usable checkpoint: what came after it is set aside
"$JOB_PY" -m primerl.resume {_q(str(run_dir.root))} --keep "logs/slurm-$SLURM_JOB_ID.out" \
  || finish 2 job "the run directory could not be prepared to resume (its log: logs/slurm-$SLURM_JOB_ID.out)"

# the nodes, and the roles on them
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
[ "${{#HOSTS[@]}}" -eq {lay.nodes} ] || finish 1 job "expected {lay.nodes} node(s), Slurm gave ${{#HOSTS[@]}}: $SLURM_JOB_NODELIST"
HEAD=${{HOSTS[0]}}
INFERENCE_HOSTS=("${{HOSTS[@]:{lay.inference_first}:{lay.inference_nodes}}}")
TRAINER_HOSTS=("${{HOSTS[@]:{lay.trainer_first}:{lay.trainer_nodes}}}")
join() {{ local IFS=,; echo "$*"; }}
CPUS=${{SLURM_CPUS_ON_NODE:-$(nproc)}}
{threads}
threads() {{ local t=$(( BASE / $1 )); echo $(( t > 0 ? t : 1 )); }}
cpus() {{ local c=$(( CPUS / $1 )); echo $(( c > 0 ? c : 1 )); }}

# the inference servers' addresses
{ports}
[ "${{#PORTS[@]}}" -eq {lay.per_node} ] || finish 1 job "could not pick {lay.per_node} port(s) for the inference servers"
URLS=()
for ((i = 0; i < {lay.servers}; i++)); do
  URLS+=("\\"http://{url_host}:${{PORTS[i % {lay.per_node}]}}\\"")
done
export JOB_PORTS="${{PORTS[*]}}" JOB_BIND={_q(bind)} JOB_SERVER_ROLES={_q(' '.join(lay.roles))}
export JOB_UP_DIR="$SLURM_DIR/job-$SLURM_JOB_ID.up"  # a file per inference server running now
mkdir -p "$JOB_UP_DIR"
export JOB_RDZV="${{TRAINER_HOSTS[0]}}:{cfg.launcher.rdzv_port}"
export JOB_MOONCAKE_HOST={_q(inf.host) if lay.shared else '"$HEAD"'}
say "job $SLURM_JOB_ID on ${{HOSTS[*]}}; inference $(join "${{URLS[@]}}")"

# launch ROLE HOSTS TASKS_PER_NODE OUTPUT: one srun step running OUT/slurm/ROLE.sh in every task
launch() {{
  local role=$1 hosts=$2 per_node=$3 output=$4 n extra=()
  n=$(( $(tr -cd , <<< "$hosts" | wc -c) + 1 ))
  (( per_node > CPUS )) && extra+=(--overcommit)
  local t; t=$(threads "$per_node")
  srun --overlap --kill-on-bad-exit=0 --nodes="$n" --nodelist="$hosts" --ntasks=$(( n * per_node )) --distribution=block \\
    --ntasks-per-node="$per_node" --cpus-per-task="$(cpus "$per_node")" ${{extra[@]+"${{extra[@]}}"}} \\
    --output="$LOGS/$output" --export="ALL,OMP_NUM_THREADS=$t,MKL_NUM_THREADS=$t" \\
    bash "$SLURM_DIR/$role.sh" &
  PIDS[$role]=$!
  say "started $role on $hosts ($(( n * per_node )) task(s), log $LOGS/$output)"
}}

# ended ROLE: true once the step of ROLE has exited; its code is then in RC
ended() {{
  kill -0 "${{PIDS[$1]}}" 2>/dev/null && return 1
  wait "${{PIDS[$1]}}"; RC=$?
  return 0
}}

{MOONCAKE_WAIT if mooncake else '# no Mooncake master: inference.kv_store is ' + _q(inf.kv_store)}
# what the job discovered, for every process: the run-time record OUT/runtime.json
{store}
{{
  printf '{{"format": "primerl.runtime", "version": 1, "inference_urls": [%s]' "$(join "${{URLS[@]}}")"
{pd_urls}  printf ', "kv_store_options": {{%s}}}}\\n' "$KV_OPTIONS"
}} > "$RUNTIME.tmp" && mv -f "$RUNTIME.tmp" "$RUNTIME"
launch inference "$(join "${{INFERENCE_HOSTS[@]}}")" {lay.per_node} {inference_log}
launch orchestrator "$HEAD" 1 orchestrator.log
launch trainer "$(join "${{TRAINER_HOSTS[@]}}")" 1 {trainer_log}  # torchrun starts trainer.nproc ranks a node

ORCHESTRATOR_DONE=0
while :; do
  if ended trainer; then
    [ "$RC" = 0 ] && finish 0 trainer "the trainer finished its last step"
    finish "$RC" trainer "the trainer exited with code $RC"
  fi
  if ended inference; then
    finish "$(( RC ? RC : 1 ))" inference "every inference server exited (the last with code $RC)"
  fi
  if [ "$ORCHESTRATOR_DONE" = 0 ] && ended orchestrator; then
    [ "$RC" = 0 ] || finish "$RC" orchestrator "the orchestrator exited with code $RC"
    ORCHESTRATOR_DONE=1  # every batch written: the trainer finishes the last steps
  fi
  {'if ended mooncake; then finish "$(( RC ? RC : 1 ))" mooncake "mooncake_master exited with code $RC"; fi' if mooncake else ':'}
  sleep {POLL_SECONDS}
done
"""


# the Mooncake master first: the servers connect to it as they start. It prints the
# addresses clients need (master=..., metadata=...) once it serves; they go into the run-time
# record (the mooncake store's options, and vLLM's Mooncake connector's).
MOONCAKE_WAIT = """launch mooncake "$HEAD" 1 mooncake.log
for _ in $(seq 240); do
  grep -q '^metadata=' "$LOGS/mooncake.log" 2>/dev/null && break
  ended mooncake && finish "$(( RC ? RC : 1 ))" mooncake "the Mooncake master exited with code $RC before serving"
  sleep 0.5
done
grep -q '^metadata=' "$LOGS/mooncake.log" || finish 1 mooncake "the Mooncake master did not serve within 120 s"
while IFS='=' read -r key value; do
  case $key in master) MOONCAKE_MASTER=$value ;; metadata) MOONCAKE_METADATA=$value ;; esac
done < "$LOGS/mooncake.log"
say "Mooncake master at $MOONCAKE_MASTER"
"""


# An inference task runs its server again on its port when it exits while another server of
# the job serves (each running server holds a file in JOB_UP_DIR), up to
# inference.max_restarts times, as the local launcher does: the orchestrator re-sends the lost
# requests and readmits the server with the current weights once /health answers. A server
# that stops cleanly, is stopped (SIGTERM/SIGINT: the job ends), exits on a config error (2)
# or is the last one up is not restarted; the batch script ends the job when every server
# has exited.
RESTARTING_SERVER = """up="$JOB_UP_DIR/$SLURM_PROCID"
restarts=0
while :; do
  touch "$up"
  {server} &
  pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid"; rm -f "$up"; exit 143' TERM INT
  rc=0
  wait "$pid" || rc=$?
  rm -f "$up"
  serving=$(find "$JOB_UP_DIR" -type f | wc -l)
  case $rc in 0 | 2 | 130 | 143) exit "$rc" ;; esac
  if [ "$restarts" -ge {max_restarts} ] || [ "$serving" -eq 0 ]; then exit "$rc"; fi
  restarts=$(( restarts + 1 ))
  echo "[primerl] the server exited with code $rc; restarting it ($restarts of at most {max_restarts})" >&2
done"""


def role_scripts(cfg: RunConfig, lay: Layout) -> dict[str, str]:
    """``OUT/slurm/<role>.sh``: what each task of a role's step runs (the batch script
    exports ``JOB_*``: its own plumbing, derived from the config and Slurm, no setting)."""
    head = "#!/bin/bash\n# a task of the job's {role} step (OUT/slurm/primerl.sbatch starts it with srun)\nset -euo pipefail\n"
    cli = '"$JOB_PY" -m primerl.cli'
    files = '@ "$JOB_CONFIG"'
    nproc = cfg.trainer.nproc
    if lay.trainer_nodes > 1:
        trainer = (f'exec "$JOB_PY" -m torch.distributed.run --nnodes={lay.trainer_nodes} '
                   f'--nproc-per-node={nproc} --rdzv-backend=c10d --rdzv-endpoint="$JOB_RDZV" '
                   f'--rdzv-id="$SLURM_JOB_ID" -m primerl.cli trainer {files}')
    elif nproc > 1:
        trainer = (f'exec "$JOB_PY" -m torch.distributed.run --standalone --nproc-per-node={nproc} '
                   f'-m primerl.cli trainer {files}')
    else:
        trainer = f"exec {cli} trainer {files}"
    if cfg.trainer.threads:  # trainer.threads replaces the task's share of the node's cores
        trainer = f"export OMP_NUM_THREADS={cfg.trainer.threads} MKL_NUM_THREADS={cfg.trainer.threads} OMP_WAIT_POLICY=PASSIVE\n" + trainer
    if nproc > 1:  # torchrun's ranks split the task's threads
        trainer = f't=$(( ${{OMP_NUM_THREADS:-{nproc}}} / {nproc} )); export OMP_NUM_THREADS=$(( t > 0 ? t : 1 )) MKL_NUM_THREADS=$(( t > 0 ? t : 1 ))\n' + trainer
    server = (f'{cli} inference {files} --inference.host "$JOB_BIND" --inference.port "${{ports[$SLURM_LOCALID]}}"'
              + (' --inference.role "${roles[$SLURM_PROCID]}"' if lay.prefill else ""))
    scripts = {
        "inference": (
            "# server SLURM_PROCID of the job's (SLURM_LOCALID of its node's): its port in JOB_PORTS,\n"
            "# its part (prefill/decode) in JOB_SERVER_ROLES\n"
            "read -r -a ports <<< \"$JOB_PORTS\"\n"
            + ("read -r -a roles <<< \"$JOB_SERVER_ROLES\"\n" if lay.prefill else "")
            + RESTARTING_SERVER.format(server=server, max_restarts=cfg.inference.max_restarts)),
        "orchestrator": f"exec {cli} orchestrator {files}",
        "trainer": trainer,
    }
    if cfg.inference.kv_store == "mooncake":  # primerl_kv_mooncake finds the binary and says what is missing
        port = 0 if lay.shared else cfg.launcher.mooncake_port  # one node: free ports; else rpc, metadata, metrics
        ports = "" if not port else f" --rpc-port {port} --metadata-port {port + 1} --metrics-port {port + 2}"
        scripts["mooncake"] = f'exec "$JOB_PY" -m primerl_kv_mooncake.master --host "$JOB_MOONCAKE_HOST"{ports}'
    return {role: head.format(role=role) + body + "\n" for role, body in scripts.items()}


def write_scripts(cfg: RunConfig, run_dir: RunDir, lay: Layout, cwd: Path) -> list[Path]:
    """Write the batch script and the role scripts into ``OUT/slurm/``; returns their paths
    (the batch script first)."""
    slurm = run_dir.root / "slurm"
    slurm.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in [(BATCH, batch_script(cfg, run_dir, lay, cwd)),
                       *((f"{role}.sh", body) for role, body in role_scripts(cfg, lay).items())]:
        path = slurm / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(path)
        written.append(path)
    for stale in ("mooncake.sh",):  # a role an earlier config had and this one has not
        if (slurm / stale) not in written:
            (slurm / stale).unlink(missing_ok=True)
    return written
