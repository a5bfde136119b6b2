# Shared by bin/run and bin/test: a virtual environment with the project, and the services it talks to.
# Sourced, not run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LLMB_VENV:-$ROOT/.venv}"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

find_python() {
  for py in python3.11 python3.12 python3.13 python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$py"; return
    fi
  done
  die "Python 3.11 or newer is needed (with its venv module); install it and run this again"
}

# setup_venv EXTRAS: create .venv once and (re)install the project when pyproject.toml changed.
setup_venv() {
  local extras="$1" stamp
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtual environment in $VENV"
    "$(find_python)" -m venv "$VENV" || die "could not create a virtual environment (on Debian: apt-get install python3-venv)"
  fi
  stamp="$VENV/.installed-$(sha1sum "$ROOT/pyproject.toml" | cut -c1-12)-${extras:-none}"
  if [ ! -f "$stamp" ]; then
    say "installing llm-batcher${extras:+[$extras]} and its dependencies"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    if [[ ",$extras," == *",models,"* ]]; then
      # torch first and pinned: an unpinned requirement would pull a multi-GB CUDA build. Set LLMB_TORCH to
      # another requirement (e.g. a CUDA build on a GPU host) to override.
      "$VENV/bin/python" -m pip install --quiet "${LLMB_TORCH:-torch==2.13.0}"
    fi
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT${extras:+[$extras]}"
    rm -f "$VENV"/.installed-*; touch "$stamp"
  fi
  export PATH="$VENV/bin:$PATH"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {  # wait_port PORT SECONDS NAME
  local i
  for ((i = 0; i < $2 * 5; i++)); do port_open "$1" && return 0; sleep 0.2; done
  die "$3 did not come up on 127.0.0.1:$1 within $2 s"
}

apt_install() {  # apt_install PACKAGE...: only where apt-get exists and we may use it
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  command -v apt-get >/dev/null 2>&1 || return 1
  [ -z "$sudo" ] || command -v sudo >/dev/null 2>&1 || return 1
  say "installing $* with apt-get"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_redis() {
  [[ "${LLMB_REDIS_URL:-redis://127.0.0.1:6379/0}" == redis://127.0.0.1:6379* || "${LLMB_REDIS_URL:-}" == redis://localhost:6379* ]] || return 0
  port_open 6379 && return 0
  command -v redis-server >/dev/null 2>&1 || apt_install redis-server || die \
    "Redis is not running and not installed. Install it (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis) or point LLMB_REDIS_URL at one"
  say "starting Redis on 127.0.0.1:6379"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
  wait_port 6379 20 Redis
}

ensure_postgres() {  # for the ledger's PostgreSQL tests (the system itself defaults to a SQLite file)
  [[ "${LLMB_TEST_POSTGRES:-postgresql://postgres@127.0.0.1:5432/test}" == *@127.0.0.1:5432* ]] || return 0
  port_open 5432 && return 0
  local fresh="" version
  if ! ls -d /etc/postgresql/*/main >/dev/null 2>&1; then
    apt_install postgresql || die \
      "PostgreSQL is not running and not installed. Install it, or set LLMB_TEST_POSTGRES to a server the tests may create databases on"
    fresh=1
  fi
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  if [ -n "$fresh" ]; then  # a server installed just for the tests: trust local TCP connections
    sed -i -E 's/^(host[[:space:]]+all[[:space:]]+all[[:space:]]+127\.0\.0\.1\/32[[:space:]]+)[a-z0-9-]+/\1trust/' \
      "/etc/postgresql/$version/main/pg_hba.conf"
  fi
  say "starting PostgreSQL $version on 127.0.0.1:5432"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start >/dev/null 2>&1 || true
  wait_port 5432 60 PostgreSQL
  if [ -n "$fresh" ]; then su postgres -c "createdb test" >/dev/null 2>&1 || true; fi
}

ensure_rabbitmq() {
  [[ "${LLMB_BROKER_URL:-amqp://guest:guest@127.0.0.1:5672//}" == *@127.0.0.1:5672* || "${LLMB_BROKER_URL:-}" == *@localhost:5672* ]] || return 0
  port_open 5672 && return 0
  command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ] || apt_install rabbitmq-server || die \
    "RabbitMQ is not running and not installed. Install it (Debian/Ubuntu: apt-get install rabbitmq-server; macOS: brew install rabbitmq) or point LLMB_BROKER_URL at one"
  say "starting RabbitMQ on 127.0.0.1:5672"
  PATH="$PATH:/usr/sbin" rabbitmq-server -detached >/dev/null 2>&1 || true
  wait_port 5672 90 RabbitMQ
}
