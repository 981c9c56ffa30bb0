"""`swaserve fleet --replicas N [serve flags]`: N `swaserve serve` replicas on consecutive ports behind
Shepherd Model Gateway (smg, `pip install 'swaserve[fleet]'`) with a prefix-affine policy.

The fleet works at process level: every replica is a plain `swaserve serve` subprocess given the serve
flags of this command (`--port`/`--host` are the router's), so how a replica serves is no concern here.
It waits for the replicas, starts the router, prints where to connect, restarts a replica that dies,
and on Ctrl-C / SIGTERM stops the router first and then the replicas. See docs/scale-out.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from swaserve.server.fleet.procs import Child, healthy_workers, http_ok, wait_until

logger = logging.getLogger("swaserve.fleet")

SMG_VERSION = "1.13.0"  # the router version this module is written and tested against
POLICIES = ("prefix_hash", "cache_aware", "round_robin", "least_load", "power_of_two", "random")
DEFAULT_POLICY = "prefix_hash"
# smg flags set by the fleet (a --router-args flag given later overrides them): fast health checks so a
# loading, draining or restarted replica is noticed within seconds (the defaults take about a minute),
# no tokenizer download (HTTP routing does not need one), a short shutdown grace.
ROUTER_DEFAULTS = (
    "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
    "--health-success-threshold", "1", "--cb-timeout-duration-secs", "10",
    "--worker-startup-check-interval", "1", "--disable-tokenizer-autoload",
    "--shutdown-grace-period-secs", "5",
)
POLICY_DEFAULTS = {"cache_aware": ("--cache-threshold", "0.05")}  # a long unique turn keeps affinity


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet (the serve flags above go to every replica; --host/--port are the "
                             "router's)")
    g.add_argument("--replicas", type=_positive("--replicas"), default=2,
                   help="replicas to start (default 2)")
    g.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help=f"smg routing policy (default {DEFAULT_POLICY}; round_robin for comparison)")
    g.add_argument("--replica-port", type=_positive("--replica-port"), default=None,
                   help="port of the first replica, the others follow (default: --port + 1)")
    g.add_argument("--replica-host", default="127.0.0.1", help="address the replicas listen on")
    g.add_argument("--devices", default=None,
                   help="comma-separated --device per replica, cycled (e.g. cuda:0,cuda:1)")
    g.add_argument("--log-dir", default=None, help="also write replica-PORT.log and router.log here")
    g.add_argument("--router-args", default="", help="extra smg flags, e.g. '--prometheus-port 29001'")
    g.add_argument("--router-log-level", choices=["debug", "info", "warn", "error"], default="warn",
                   help="smg log level (default warn: worker health changes, errors)")
    g.add_argument("--no-restart", dest="restart", action="store_false",
                   help="do not restart a replica that exits (default: restart it)")
    g.add_argument("--replica-timeout", type=float, default=900.0,
                   help="seconds to wait for a replica's /health (default 900)")


def _positive(flag: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {s!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be at least 1, got {v}")
        return v
    return parse


def _fleet_only_parser() -> argparse.ArgumentParser:
    """The fleet's own flags plus --host/--port: what is not forwarded to the replicas."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_fleet_args(p)
    p.add_argument("--host")
    p.add_argument("--port")
    return p


def replica_flags(raw: list[str]) -> list[str]:
    """The serve flags in `raw` (the arguments after `fleet`), i.e. without the fleet's own flags."""
    _, rest = _fleet_only_parser().parse_known_args(raw)
    return rest


@dataclass(frozen=True)
class FleetPlan:
    """Everything `run_fleet` starts, decided (and checked) before anything starts."""

    replica_argvs: list[list[str]]
    replica_urls: list[str]
    router_argv: list[str]
    router_url: str
    cpu_note: str | None
    api_key: str | None
    metrics_url: str


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port p such that p .. p + count - 1 are free now (a fleet takes the router's port and the next
    ones for its replicas); tries up to 100 ephemeral candidates."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        try:
            for q in range(port + 1, port + count):
                _check_free(host, q, "port")
        except ValueError:
            continue
        if port + count <= 65536:
            return port
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def _check_free(host: str, port: int, what: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"{what}: cannot listen on {host}:{port}: {e.strerror}") from None


def _url(host: str, port: int) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def router_command(worker_urls: list[str], host: str, port: int, policy: str, *, log_level: str = "warn",
                   api_key: str | None = None, metrics_port: int | None = None,
                   max_running_requests: int = 64, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """`python -m smg launch ...` in front of `worker_urls`; `extra` flags come last and win.

    smg leaves a worker out of routing once it reports 8 waiting requests (its default). A swaserve
    replica queues a burst of siblings behind one prefill of their shared prefix, a short wait: at 8
    the veto sent half the fan-out groups of a 64-request burst to the replica without their prefix
    (docs/scale-out.md). The fleet moves the threshold to a replica's --max-running-requests: a queue
    of a whole batch is overload."""
    argv = [sys.executable, "-m", "smg", "launch", "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, *ROUTER_DEFAULTS,
            "--worker-overload-waiting-requests", str(max_running_requests),
            *POLICY_DEFAULTS.get(policy, ()), "--log-level", log_level,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port or free_port())]
    if api_key:
        argv += ["--api-key", api_key]  # smg checks it on clients and sends it to the replicas
    return argv + list(extra)


def redacted(argv: list[str]) -> list[str]:
    """`argv` with the value of every --api-key replaced (for logs)."""
    return [("***" if i and argv[i - 1] == "--api-key" else a) for i, a in enumerate(argv)]


def check_router_installed() -> None:
    """ValueError (one line on the CLI) when smg is missing."""
    if importlib.util.find_spec("smg") is None:
        raise ValueError("the router is not installed: pip install 'swaserve[fleet]' (Shepherd Model "
                         f"Gateway, smg=={SMG_VERSION})")
    from importlib import metadata

    try:
        have = metadata.version("smg")
    except metadata.PackageNotFoundError:
        have = "unknown"
    if have != SMG_VERSION:
        logger.warning("smg %s is installed; swaserve fleet is tested with smg==%s", have, SMG_VERSION)


def plan_fleet(args: argparse.Namespace, raw: list[str]) -> FleetPlan:
    """Validate the flags (ValueError with one line) and build the command lines."""
    from swaserve.engine.args import engine_config_from_args
    from swaserve.server.launch import server_config_from_args

    engine_config_from_args(args)  # the replicas' flags, checked once here
    server_config_from_args(args)
    check_router_installed()
    n = args.replicas
    first = args.replica_port if args.replica_port is not None else args.port + 1
    ports = list(range(first, first + n))
    if ports[-1] > 65535:
        raise ValueError(f"replica ports {first}..{ports[-1]} run past 65535: lower --replica-port")
    if args.port in ports and args.host in (args.replica_host, "0.0.0.0"):
        raise ValueError(f"--port {args.port} is also a replica port ({first}..{ports[-1]})")
    _check_free(args.host, args.port, "router")
    for p in ports:
        _check_free(args.replica_host, p, "replica")
    flags = replica_flags(raw)
    cpu_note = None
    if args.cpu_threads is None:
        cores = os.cpu_count() or 1
        threads = max(1, cores // n)
        flags += ["--cpu-threads", str(threads)]
        cpu_note = (f"{n} replicas share {cores} CPU cores: --cpu-threads {threads} each (set --cpu-threads "
                    "to change)")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else []
    if args.devices is not None and not devices:
        raise ValueError("--devices is empty")
    argvs = []
    for i, port in enumerate(ports):
        dev = ["--device", devices[i % len(devices)]] if devices else []
        argvs.append([sys.executable, "-m", "swaserve.cli", "serve", *flags, *dev,
                      "--host", args.replica_host, "--port", str(port)])
    urls = [_url(args.replica_host, p) for p in ports]
    try:
        extra = shlex.split(args.router_args)
    except ValueError as e:
        raise ValueError(f"--router-args: {e}") from None
    metrics_port = free_port()
    if "--prometheus-port" in extra[:-1]:
        value = extra[extra.index("--prometheus-port") + 1]
        if not value.isdigit():
            raise ValueError(f"--router-args: --prometheus-port must be a port number, got {value!r}")
        metrics_port = int(value)
    router = router_command(urls, args.host, args.port, args.policy, log_level=args.router_log_level,
                            api_key=args.api_key, metrics_port=metrics_port,
                            max_running_requests=args.max_running_requests, extra=extra)
    return FleetPlan(argvs, urls, router, _url(args.host, args.port), cpu_note, args.api_key,
                     f"http://127.0.0.1:{metrics_port}/metrics")


class Fleet:
    """Starts, watches and stops the children of one plan."""

    def __init__(self, plan: FleetPlan, args: argparse.Namespace):
        self.plan, self.args = plan, args
        self.stop_event = threading.Event()
        self.replicas: list[Child | None] = [None] * len(plan.replica_argvs)
        self.router: Child | None = None
        self.restart_at: dict[int, float] = {}  # replica index -> when to start it again
        self.backoff: dict[int, float] = {}
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)

    def _log_path(self, name: str) -> str | None:
        return os.path.join(self.args.log_dir, f"{name}.log") if self.args.log_dir else None

    def _replica_name(self, i: int) -> str:
        return f"replica {i + 1} :{self.plan.replica_urls[i].rsplit(':', 1)[1]}"

    def start_replica(self, i: int) -> Child:
        port = self.plan.replica_urls[i].rsplit(":", 1)[1]
        child = Child(self._replica_name(i), self.plan.replica_argvs[i], self._log_path(f"replica-{port}"))
        self.replicas[i] = child
        return child

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.plan.api_key}"} if self.plan.api_key else {}

    def start(self) -> bool:
        """Replicas, then the router once every replica is healthy; False if something failed."""
        t0 = time.monotonic()
        for i in range(len(self.replicas)):
            self.start_replica(i)
        logger.info("started %d replicas on %s; waiting for them to load", len(self.replicas),
                    ", ".join(self.plan.replica_urls))
        for i, url in enumerate(self.plan.replica_urls):
            child = self.replicas[i]
            assert child is not None
            if not wait_until(lambda u=url: http_ok(f"{u}/health"), self.args.replica_timeout, child.alive,
                              self.stop_event):
                if not self.stop_event.is_set():
                    why = (f"exited with code {child.returncode}" if not child.alive() else
                           f"was not healthy after {self.args.replica_timeout:.0f} s")
                    logger.error("%s %s; last lines:\n  %s", child.name, why, "\n  ".join(child.tail))
                return False
            logger.info("%s ready (%d/%d) after %.1f s", child.name, i + 1, len(self.replicas),
                        time.monotonic() - t0)
        logger.info("starting the router: %s", shlex.join(redacted(self.plan.router_argv)))
        self.router = Child("router", self.plan.router_argv, self._log_path("router"))
        want = set(self.plan.replica_urls)
        if not wait_until(lambda: healthy_workers(self.plan.router_url, self._headers()) >= want, 120,
                          self.router.alive, self.stop_event):
            if not self.stop_event.is_set():
                logger.error("the router did not register the replicas (smg %s); last lines:\n  %s",
                             "exited" if not self.router.alive() else "still starting",
                             "\n  ".join(self.router.tail))
            return False
        return True

    def watch(self) -> int:
        """Until stopped: restart replicas that exit (with a backoff); 1 if the router exits."""
        while not self.stop_event.wait(0.5):
            assert self.router is not None
            if not self.router.alive():
                logger.error("the router exited with code %s; stopping the fleet", self.router.returncode)
                return 1
            now = time.monotonic()
            for i, child in enumerate(self.replicas):
                if i in self.restart_at:
                    if now >= self.restart_at[i]:
                        del self.restart_at[i]
                        logger.info("restarting %s", self._replica_name(i))
                        self.start_replica(i)
                    continue
                if child is None or child.alive():
                    continue
                if not self.args.restart:
                    logger.warning("%s exited with code %s (not restarted: --no-restart)", child.name,
                                   child.returncode)
                    self.replicas[i] = None
                    continue
                quick = now - child.started_at < 60  # died young: back off, it may crash-loop
                delay = min(30.0, self.backoff.get(i, 0.5) * 2) if quick else 1.0
                self.backoff[i] = delay
                self.restart_at[i] = now + delay
                logger.warning("%s exited with code %s; restarting in %.0f s (the router sends its "
                               "traffic to the others meanwhile)", child.name, child.returncode, delay)
        return 0

    def stop(self) -> None:
        """The router first (no new traffic), then every replica; SIGKILL for any that lingers."""
        if self.router is not None:
            self.router.stop(timeout=8)
        replicas = [child for child in self.replicas if child is not None]
        for child in replicas:  # all at once: they shut down in parallel
            child.terminate()
        for child in replicas:
            child.stop(timeout=15)
        logger.info("fleet stopped")


def run_fleet(args: argparse.Namespace, raw: list[str]) -> int:
    """Entry point of `swaserve fleet`; ValueError (one line from cli.py) for bad flags."""
    plan = plan_fleet(args, raw)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
    if plan.cpu_note:
        logger.info(plan.cpu_note)
    fleet = Fleet(plan, args)

    def on_signal(signum: int, frame: object) -> None:
        if not fleet.stop_event.is_set():
            logger.info("%s: stopping the fleet", signal.Signals(signum).name)
        fleet.stop_event.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 1
    try:
        if fleet.start():
            logger.info("swaserve fleet ready: %s/v1 (smg, policy %s) in front of %s; router metrics %s",
                        plan.router_url, args.policy, ", ".join(plan.replica_urls), plan.metrics_url)
            print(f"swaserve fleet: serving on {plan.router_url}/v1 (policy {args.policy}; replicas "
                  f"{' '.join(plan.replica_urls)}); Ctrl-C stops everything", flush=True)
            rc = fleet.watch()
        elif fleet.stop_event.is_set():
            rc = 0
    finally:
        fleet.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return rc
