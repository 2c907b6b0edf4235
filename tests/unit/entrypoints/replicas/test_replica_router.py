"""The replica router (prefix tree, sessions, load), the metrics merge and the replica argv."""

import pytest

from specdec.config import ConfigError
from specdec.entrypoints.replicas.cores import split_cores
from specdec.entrypoints.replicas.front import merge_metrics
from specdec.entrypoints.replicas.pool import replica_argv
from specdec.entrypoints.replicas.router import (
    CHUNK_CHARS,
    Choice,
    PrefixTree,
    Router,
    RouterConfig,
    rendezvous,
    routing_salt,
    routing_text,
)

LONG = "You are a careful assistant. Answer in one short paragraph. " * 8


def test_prefix_tree_matches_whole_chunks_and_evicts_oldest():
    tree = PrefixTree(max_nodes=40)
    tree.insert(LONG + "first question")
    assert tree.match(LONG + "another question") >= len(LONG) - CHUNK_CHARS
    assert tree.match("unrelated text " * 4) == 0
    for i in range(30):  # far more nodes than the bound
        tree.insert(f"{i:04d}" * 8)
    assert tree.num_nodes <= 40
    assert tree.match(f"{29:04d}" * 8) == 32  # the newest survived
    assert tree.match(LONG) == 0  # the oldest went first, branch and all


def test_shared_prefix_goes_to_one_replica():
    router = Router()
    first = router.choose(LONG + "q0", None, {0: 0, 1: 0, 2: 0}).replica
    for i in range(1, 6):
        loads = {r: int(r == first) for r in range(3)}  # the warm replica is a little busier
        choice = router.choose(LONG + f"question {i}", None, loads)
        assert (choice.replica, choice.reason) == (first, "prefix")


def test_idle_ties_take_turns():
    router = Router()
    served = {router.choose(f"topic {i} " * 10, None, {0: 0, 1: 0}).replica for i in range(4)}
    assert served == {0, 1}


def test_round_robin_ignores_affinity():
    router = Router(RouterConfig(policy="round_robin"))
    served = [router.choose(LONG, "s", {0: 0, 1: 0}).replica for _ in range(4)]
    assert sorted(served) == [0, 0, 1, 1]


def test_new_text_goes_to_least_loaded():
    router = Router()
    router.choose(LONG, None, {0: 0, 1: 0, 2: 0})
    choice = router.choose("something else entirely " * 4, None, {0: 3, 1: 1, 2: 2})
    assert (choice.replica, choice.reason) == (1, "least_loaded")


def test_imbalance_overrides_affinity():
    router = Router(RouterConfig(imbalanced_threshold=4))
    warm = router.choose(LONG, "s1", {0: 0, 1: 0}).replica
    cold = 1 - warm
    choice = router.choose(LONG, "s1", {warm: 9, cold: 0})
    assert (choice.replica, choice.reason) == (cold, "least_loaded")
    assert router.choose(LONG, "s1", {warm: 4, cold: 0}).replica == warm  # within the threshold


def test_sessions_are_sticky_and_consistent():
    router = Router()
    loads = {r: 0 for r in range(4)}
    homes = {f"s{i}": router.choose(f"turn {i}", f"s{i}", loads).replica for i in range(40)}
    assert len(set(homes.values())) > 1  # spread over replicas
    for s, home in homes.items():
        assert router.choose("a different prompt", s, loads).replica == home
    # replica 2 goes away: only its sessions move
    without = {r: 0 for r in (0, 1, 3)}
    for s, home in homes.items():
        if home != 2:
            assert rendezvous(s, sorted(without)) == home


def test_reset_forgets_a_replica():
    router = Router()
    warm = router.choose(LONG, None, {0: 0, 1: 0}).replica
    router.reset(warm)
    assert router.tree(warm).match(LONG) == 0


def test_a_salt_keys_affinity_and_hides_other_tenants_prefixes():
    """The side channel: a tenant guessing another's text under its own salt is routed as for
    random text (never "prefix"); the same salt keeps its affinity; unsalted text stays apart."""
    router = Router()
    secret = LONG + "codename BLUEBIRD, launch at dawn"
    warm = router.choose(secret, None, {0: 0, 1: 0, 2: 0}, salt="tenant-a").replica
    for guess_salt in ("tenant-b", None):
        loads = {r: 0 for r in range(3)}
        choice = router.choose(secret, None, loads, salt=guess_salt)
        assert choice.reason == "least_loaded", guess_salt
    loads = {r: int(r == warm) for r in range(3)}
    assert router.choose(LONG + "next", None, loads, salt="tenant-a") == Choice(warm, "prefix")


def test_short_texts_share_no_prefix_through_the_salt_chunk():
    router = Router()
    router.choose("hi", None, {0: 0, 1: 0})
    reasons = {router.choose(f"q{i}", None, {0: 0, 1: 0}).reason for i in range(6)}
    assert reasons == {"least_loaded"}


def test_routing_salt():
    assert routing_salt({"cache_salt": "abc"}) == "abc"
    assert routing_salt({"cache_salt": ""}) is None and routing_salt({"cache_salt": 5}) is None
    assert routing_salt({}) is None


def test_no_replica_is_an_error():
    with pytest.raises(ValueError):
        Router().choose("x", None, {})


def test_routing_text():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}  # fmt: skip
    assert routing_text(chat) == "<system>S<user>hi"
    assert routing_text({"prompt": "abc"}) == "abc"
    assert routing_text({"prompt": ["abc", "def"]}) == "abc"
    assert routing_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert routing_text({"prompt": None}) == ""


def test_merge_metrics_labels_every_sample_once_per_family():
    text = (
        "# HELP a:x_total X.\n# TYPE a:x_total counter\na:x_total 3.0\n"
        '# HELP a:h H.\n# TYPE a:h histogram\na:h_bucket{le="1.0",model_name="m"} 1.0\n'
    )
    merged = merge_metrics({0: text, 1: text})
    assert merged.count("# TYPE a:x_total counter") == 1
    assert 'a:x_total{replica="0"} 3.0' in merged and 'a:x_total{replica="1"} 3.0' in merged
    assert 'a:h_bucket{replica="1",le="1.0",model_name="m"} 1.0' in merged
    lines = merged.splitlines()  # a family's samples follow its header
    assert lines.index('a:x_total{replica="1"} 3.0') < lines.index("# HELP a:h H.")


def test_replica_argv_drops_the_front_flags():
    argv = [
        "smollm2-135m", "-dp", "2", "--host", "0.0.0.0", "--port=9000", "--api-key", "k",
        "--allowed-hosts", "a", "b", "--max-model-len", "512", "--replica-cpu-binding", "0|1",
    ]  # fmt: skip
    assert replica_argv(argv) == ["smollm2-135m", "--max-model-len", "512"]


def test_split_cores():
    groups = split_cores(2)
    assert len(groups) == 2 and all(groups)
    usable = sorted(split_cores(1)[0])
    assert split_cores(1, f"{usable[0]}") == [[usable[0]]]
    with pytest.raises(ConfigError, match="--replica-cpu-binding"):
        split_cores(2, "0", "--replica-cpu-binding")
    with pytest.raises(ConfigError, match="cannot use"):
        split_cores(1, "100000")


def test_ttft_for_a_ray_autoscaling_policy():
    """The engine's TTFT histogram read back from /metrics text, and the mean over a window."""
    import asyncio

    from specdec.entrypoints.replicas import ray_app

    def text(total: float, count: int, prefix: str = "vllm:") -> str:
        name = f"{prefix}time_to_first_token_seconds"
        return (f"# TYPE {name} histogram\n{name}_bucket{{le=\"+Inf\",model_name=\"m\"}} {count}\n"
                f"{name}_sum{{model_name=\"m\"}} {total}\n{name}_count{{model_name=\"m\"}} {count}\n"
                f"{name}_sum{{model_name=\"n\"}} 1.0\n{name}_count{{model_name=\"n\"}} 1\n")  # fmt: skip

    assert ray_app.histogram_totals(text(2.5, 4), "time_to_first_token_seconds") == (3.5, 5)
    assert ray_app.histogram_totals(text(2.5, 4, "specdec:"), "time_to_first_token_seconds") == (3.5, 5)  # fmt: skip
    assert ray_app.histogram_totals("", "time_to_first_token_seconds") == (0.0, 0.0)
    mean = ray_app.TrailingMean(window_s=30.0)
    assert mean.observe(0.0, (0.0, 0)) == 0.0  # no request yet
    assert mean.observe(10.0, (3.0, 2)) == 1.5
    assert mean.observe(35.0, (4.0, 4)) == 1.0  # (5, 35]: back to the newest reading before 5
    assert mean.observe(41.0, (4.0, 4)) == 0.5  # (11, 41]: 2 requests since the reading at 10
    assert mean.observe(70.0, (4.0, 4)) == 0.0  # idle for a whole window
    assert mean.observe(71.0, (0.6, 2)) == 0.3  # a reset counter (a restarted engine)

    engine = object.__new__(ray_app.SpecdecEngine)  # the replica's stats method, no Ray
    engine._ttft = ray_app.TrailingMean(window_s=1e9)
    readings = iter([text(0.0, 0), text(1.0, 2), text(1.0, 2)])

    async def metrics() -> dict:
        return {"replica": "r", "text": next(readings)}

    engine.metrics = metrics
    got = [asyncio.run(engine.record_autoscaling_stats()) for _ in range(3)]
    assert [g[ray_app.TTFT_METRIC] for g in got] == [1.0, 2 / 3, 2 / 3]


def test_merge_metrics_takes_ray_replica_ids():
    merged = merge_metrics({"abc12": "# TYPE a:g gauge\na:g 1\n", "def34": "a:g 2\n"})
    assert 'a:g{replica="abc12"} 1' in merged and 'a:g{replica="def34"} 2' in merged


def test_ray_engine_resources_per_replica():
    """A tensor-parallel Ray replica: one CPU bundle per rank, packed on one host."""
    import argparse

    from specdec.entrypoints.openai.api_server import make_arg_parser
    from specdec.entrypoints.replicas.ray_app import engine_resources

    parser = argparse.ArgumentParser()
    make_arg_parser(parser)

    def parse(*flags: str) -> dict:
        return engine_resources(parser.parse_args(["--model", "m", "--ray", *flags]))

    assert parse("--num-replicas", "2") == {"ray_actor_options": {"num_cpus": 1}, "num_replicas": 2}
    got = parse("--num-replicas", "2", "-tp", "2", "--threads", "3")
    assert got["placement_group_bundles"] == [{"CPU": 3}, {"CPU": 3}]
    assert got["placement_group_strategy"] == "STRICT_PACK"
    assert got["ray_actor_options"] == {"num_cpus": 3} and got["num_replicas"] == 2
    got = parse("--min-replicas", "1", "--max-replicas", "3", "--threads", "2")
    assert got["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in got
    assert got["ray_actor_options"] == {"num_cpus": 2}
    policy = "my_policies:ttft"
    got = parse("--max-replicas", "2", "--autoscaling-policy", policy)
    assert got["autoscaling_config"]["policy"] == {"policy_function": policy}


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--num-replicas", "2"], "--num-replicas needs --ray"),
        (["--ray", "--num-replicas", "0"], "--num-replicas"),
        (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--max-replicas"),
        (["--ray", "--target-ongoing-requests", "0"], "--target-ongoing-requests"),
        (["--ray", "--autoscaling-policy", "m:f"], "--autoscaling-policy"),
        (
            ["--ray", "--max-replicas", "2", "--autoscaling-policy", "nocolon"],
            "--autoscaling-policy",
        ),
    ],
)
def test_bad_ray_flags_are_one_line_errors(flags, field):
    import argparse

    from specdec.entrypoints.openai.api_server import make_arg_parser
    from specdec.entrypoints.replicas.ray_app import check_ray_args

    parser = argparse.ArgumentParser()
    make_arg_parser(parser)
    with pytest.raises(ConfigError, match=field) as e:
        check_ray_args(parser.parse_args(["--model", "m", *flags]))
    assert "\n" not in str(e.value)
    check_ray_args(parser.parse_args(["--model", "m", "--ray", "--max-replicas", "2", "--autoscaling-policy", "m:f"]))  # fmt: skip


def test_replicas_refuse_a_per_rank_binding_and_dp_with_ray(monkeypatch):
    import argparse

    from specdec.entrypoints.openai.api_server import make_arg_parser
    from specdec.entrypoints.replicas.serve import check_replica_binding

    parser = argparse.ArgumentParser()
    make_arg_parser(parser)

    def check(*flags: str) -> None:
        check_replica_binding(parser.parse_args(["--model", "m", *flags]))

    monkeypatch.delenv("SPECDEC_CPU_OMP_THREADS_BIND", raising=False)
    check("-dp", "2", "-tp", "2")
    check("-tp", "2", "--cpu-binding", "0|1")  # one engine: its ranks' binding
    with pytest.raises(ConfigError, match="--cpu-binding"):
        check("-dp", "2", "-tp", "2", "--cpu-binding", "0|1")
    with pytest.raises(ConfigError, match="--num-replicas"):
        check("-dp", "2", "--ray")
    monkeypatch.setenv("SPECDEC_CPU_OMP_THREADS_BIND", "0|1")
    check("-dp", "2")  # NOTE: one rank per replica: the variable is not read
    with pytest.raises(ConfigError, match="SPECDEC_CPU_OMP_THREADS_BIND"):
        check("-dp", "2", "-tp", "2")


def test_tensor_parallel_ray_replicas_take_distinct_cores():
    from specdec.entrypoints.replicas.ray_app import replica_cores

    usable = list(range(16))
    assert replica_cores(usable, 0, 4) == [0, 1, 2, 3]
    assert replica_cores(usable, 1, 4) == [4, 5, 6, 7]
    assert replica_cores(usable, 5, 4) == [4, 5, 6, 7]  # more replicas than groups: they share
    assert replica_cores([0, 1], 1, 4) == [0, 1]  # a replica wider than the host: all of it
