"""`quantgate fleet up|status|promote|rollback|weights|down`: the fleet on Ray Serve."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    fleet = subparsers.add_parser("fleet", help="replicated serving on Ray Serve: versions, traffic split, autoscaling")
    verbs = fleet.add_subparsers(dest="fleet_command", metavar="<action>", required=True)

    p = verbs.add_parser("up", help="start (or update) the fleet of a fleet.yaml")
    p.add_argument("--config", required=True, metavar="FILE", help="fleet YAML (docs/fleet.md)")
    p.add_argument("--address", default=None,
                   help="a running Ray cluster (`auto`, or ray://host:10001 / host:6379) to deploy to and return; "
                        "without it a local Ray starts and the fleet runs in the foreground until Ctrl-C or `fleet down`")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default 2)")
    p.set_defaults(func=_up)

    for name, what in (("status", "versions, weights, replicas and their cold starts, the change history"),
                       ("down", "delete the fleet's application")):
        p = verbs.add_parser(name, help=what)
        _which(p)
        p.set_defaults(func=_status if name == "status" else _down)

    p = verbs.add_parser("promote", help="send all traffic to VERSION, live, recorded with the reason")
    p.add_argument("version")
    p.add_argument("--reason", required=True)
    _which(p)
    p.set_defaults(func=_traffic, action="promote")

    p = verbs.add_parser("rollback", help="the versions on trial to 0, the starting champion back")
    p.add_argument("--reason", required=True)
    _which(p)
    p.set_defaults(func=_traffic, action="rollback", version=None)

    p = verbs.add_parser("weights", help="set the split, e.g. champion=0.9 challenger=0.1")
    p.add_argument("weights", nargs="+", metavar="VERSION=W")
    p.add_argument("--reason", required=True)
    _which(p)
    p.set_defaults(func=_traffic, action="weights", version=None)


def _which(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=None, help="the fleet (default: the only one up)")
    p.add_argument("--config", default=None, metavar="FILE", help="or the fleet YAML it was started from")


def _name(args: argparse.Namespace) -> str:
    if args.name:
        return args.name
    if args.config:
        from fleet.config import load_fleet_config

        return load_fleet_config(args.config).name
    from quantgate.env import home

    names = sorted(p.stem for p in (home() / "fleet").glob("*.json"))
    if len(names) != 1:
        raise ValueError(f"name the fleet with --name ({'fleets up: ' + ', '.join(names) if names else 'none is up'})")
    return names[0]


def _auth(args: argparse.Namespace) -> dict:
    """The admin key from --config (admin_key or admin_key_env), else $QUANTGATE_FLEET_ADMIN_KEY."""
    from quantgate import settings

    key = settings.FLEET_ADMIN_KEY.raw() or None
    if args.config:
        from fleet.config import load_fleet_config

        key = load_fleet_config(args.config).resolved_admin_key() or key
    return {"Authorization": f"Bearer {key}"} if key else {}


def _up(args: argparse.Namespace) -> int:
    import time

    from fleet.app import up
    from fleet.config import load_fleet_config

    config = load_fleet_config(args.config)
    info = up(config, address=args.address, num_cpus=args.num_cpus, record=True)
    print(f"fleet {info['name']} up in {info['up_s']:.1f} s at {info['url']} (Ray {info['ray_address']})")
    if args.address:
        return 0
    from ray import serve

    from fleet.app import stop_file

    print("serving in the foreground; Ctrl-C or `quantgate fleet down` stops it")
    try:
        while info["name"] in serve.status().applications and not stop_file(info["name"]).exists():
            time.sleep(1.0)
    finally:
        _shutdown(info["name"])
    return 0


def _shutdown(name: str) -> None:
    import ray
    from ray import serve

    from fleet.app import forget

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        forget(name)


def _status(args: argparse.Namespace) -> int:
    import httpx

    from fleet.app import live_replicas, saved

    info = saved(_name(args))
    r = httpx.get(f"{info['url']}/fleet/state", headers=_auth(args), timeout=10)
    if r.status_code != 200:
        raise ValueError(r.json().get("error", {}).get("message", r.text))
    traffic = r.json()
    serve_status = {"status": traffic.get("status", "?"), "deployments": traffic.get("deployments", {}),
                    "replicas": live_replicas(info["name"])}
    print(f"fleet {info['name']} at {info['url']}: {serve_status['status']}")
    print("  weights: " + ", ".join(f"{n}={w:g}" for n, w in traffic["weights"].items())
          + f"  (champion {traffic['champion']})")
    for dep, d in serve_status["deployments"].items():
        print(f"  {dep}: {d['status']} {d['replica_states']}")
    for r in serve_status["replicas"]:
        c = r["cold_start"]
        print(f"    replica {r['replica']} ({r['version']}, pid {r['pid']}): cold start {c['total_s']:.1f} s "
              f"(imports {c.get('import_s', 0):.1f}, read {c['read_s']:.1f}, load {c['load_s']:.1f}, tokenizer {c['tokenizer_s']:.1f}, "
              f"KV {c['kv_alloc_s']:.1f}, first forward {c['first_forward_s']:.2f}; {c['num_kv_blocks']} blocks)")
    print("  history:")
    for h in traffic["history"]:
        print(f"    {h['time_iso']} {h['action']:<8} {json.dumps(h['weights'])} champion={h['champion']}: {h['reason']}")
    return 0


def _traffic(args: argparse.Namespace) -> int:
    import httpx

    from fleet.app import saved

    info = saved(_name(args))
    body: dict = {"action": args.action, "reason": args.reason}
    if args.action == "promote":
        body["version"] = args.version
    if args.action == "weights":
        try:
            body["weights"] = {k: float(v) for k, _, v in (w.partition("=") for w in args.weights)}
        except ValueError:
            raise ValueError(f"weights are VERSION=NUMBER, got {' '.join(args.weights)}") from None
    r = httpx.post(f"{info['url']}/fleet/traffic", json=body, headers=_auth(args), timeout=10)
    data = r.json()
    if r.status_code != 200:
        raise ValueError(data.get("error", {}).get("message", r.text))
    c = data["change"]
    print(f"{c['time_iso']} {c['action']}: weights {json.dumps(c['weights'])}, champion {c['champion']} ({c['reason']})")
    return 0


def _down(args: argparse.Namespace) -> int:
    from fleet.app import down

    name = _name(args)
    down(name)
    print(f"fleet {name} deleted")
    return 0
