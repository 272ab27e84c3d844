import subprocess
import sys
from pathlib import Path

import pytest

from pegaflow.config.commands import CONFIGS, NodeConfig, field_names, load, node_config
from pegaflow.config.options import NODE, render_markdown
from pegaflow.core.units import parse_size
from tests.harness import forked

ROOT = Path(__file__).resolve().parents[2]


def test_sizes_use_binary_units():
    assert parse_size("30gb") == 30 << 30
    assert parse_size("512MB") == 512 << 20
    assert parse_size("1tb") == 1 << 40
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("12zb")


def test_node_defaults_match_the_original():
    o = load(NODE, "pegaflow-node", [], env={})
    assert o.addr == "127.0.0.1:50055"
    assert o.pool_size == 30 << 30
    assert o.use_hugepages is False


def test_flag_beats_environment_beats_default():
    env = {"PEGAFLOW_POOL_SIZE": "2gb", "PEGAFLOW_ADDR": "127.0.0.1:6000"}
    o = load(NODE, "pegaflow-node", ["--addr", "127.0.0.1:7000"], env=env)
    assert o.pool_size == 2 << 30 and o.addr == "127.0.0.1:7000"


def test_docs_options_page_is_generated_from_the_table():
    assert (ROOT / "docs" / "options.md").read_text() == render_markdown(), (
        "docs/options.md is stale: python -m pegaflow.config.options > docs/options.md"
    )


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--pool-size", "lots"], "--pool-size"),
        (["--addr", "nowhere"], "--addr"),
        (["--no-such-flag"], "unrecognized"),
        (["--log-level", "chatty"], "--log-level"),
        (["--node-id", "gpu{1}"], "--node-id"),  # braces: a hash tag in its Redis keys
        (["--page-align", "3"], "--page-align: must be a power of two, got 3"),  # was the allocator's traceback
        (["--page-align", "99999999999999999999"], "must be a power of two"),
    ],
)
def test_bad_flags_exit_with_one_line(argv, needle):
    p = forked.run([sys.executable, "-m", "pegaflow.node.cli", *argv])
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_bad_environment_value_exits_with_one_line():
    p = subprocess.run(
        [sys.executable, "-m", "pegaflow.node.cli"], capture_output=True, text=True, timeout=60,
        env={"PEGAFLOW_POOL_SIZE": "huge", "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "PEGAFLOW_POOL_SIZE" in p.stderr


# The original's quick start (novitalabs/pegaflow docs/p2p.md, docs/server.md), flag for flag.
ORIGINAL_P2P_NODE = (
    "--addr 10.0.0.11:50055 --pool-size 30gb --ssd-cache-path /mnt/nvme0 --nics mlx5_0 mlx5_1 "
    "--metaserver-addr http://metaserver-host:50056"
).split()


def test_the_originals_p2p_node_command_line_parses():
    o = load(NODE, "pegaflow-server", ORIGINAL_P2P_NODE, env={})
    assert o.addr == "10.0.0.11:50055" and o.pool_size == 30 << 30
    assert o.ssd_cache_path == ("/mnt/nvme0",)
    assert o.nics == ("mlx5_0", "mlx5_1")
    assert o.metaserver_addr == "metaserver-host:50056"


@pytest.mark.parametrize(
    "argv",
    [
        ["--nics", "mlx5_0", "mlx5_1"],
        ["--nics", "mlx5_0", "--nics", "mlx5_1"],
        ["--nics", "mlx5_0,mlx5_1"],
        ["--nics", "mlx5_0,", "mlx5_1"],
    ],
)
def test_nics_take_several_values_after_one_flag_repeated_or_comma_separated(argv):
    assert load(NODE, "pegaflow-node", argv, env={}).nics == ("mlx5_0", "mlx5_1")


def test_several_ssd_paths_after_one_flag_or_repeated():
    one = load(NODE, "n", ["--ssd-cache-path", "/a", "/b"], env={})
    rep = load(NODE, "n", ["--ssd-cache-path", "/a", "--ssd-cache-path", "/b"], env={})
    assert one.ssd_cache_path == rep.ssd_cache_path == ("/a", "/b")


@pytest.mark.parametrize(
    "value, want",
    [
        ("http://10.0.0.100:50056", "10.0.0.100:50056"),
        ("http://meta:50056/", "meta:50056"),
        ("HTTP://meta:50056", "meta:50056"),
        ("meta:50056", "meta:50056"),
        ("http://[::1]:50056", "[::1]:50056"),
        ("", ""),
    ],
)
def test_metaserver_addr_takes_the_url_and_the_host_port_forms(value, want):
    assert load(NODE, "n", ["--metaserver-addr", value], env={}).metaserver_addr == want


def test_meta_addr_is_an_alias_as_flag_and_as_environment_variable():
    assert load(NODE, "n", ["--meta-addr", "m:1"], env={}).metaserver_addr == "m:1"
    assert load(NODE, "n", [], env={"PEGAFLOW_META_ADDR": "m:2"}).metaserver_addr == "m:2"
    both = {"PEGAFLOW_META_ADDR": "m:2", "PEGAFLOW_METASERVER_ADDR": "http://m:3"}
    assert load(NODE, "n", [], env=both).metaserver_addr == "m:3"


@pytest.mark.parametrize("argv", [["--metaserver-addr", "ftp://m:1"], ["--metaserver-addr", "http://m"],
                                  ["--nics", ","], ["--nics"],
                                  # a node took these and retried publishing forever (the metaserver refused them)
                                  ["--redis-url", "redis://:99999"], ["--redis-url", "redis://h:0/0"],
                                  ["--redis-url", "unix://"], ["--redis-url", "redis://h:1/0?socket_timeout=abc"]])
def test_bad_cluster_flags_exit_with_one_line(argv):
    p = forked.run([sys.executable, "-m", "pegaflow.node.cli", *argv])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "--" in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_metaserver_redis_defaults_to_the_local_redis():
    from pegaflow.config.options import META

    assert load(META, "pegaflow-metaserver", ["--addr", "0.0.0.0:50056"], env={}).redis_url == (
        "redis://127.0.0.1:6379/0",
    )
    assert load(NODE, "pegaflow-node", [], env={}).redis_url == ()


@pytest.mark.parametrize("command", ["node", "meta"])
def test_redis_seeds_are_the_flag_repeated_or_comma_separated_in_order_each_once(command: str):
    a, b, c = "redis://10.0.0.1:6379/0", "redis://10.0.0.2:6380/0", "redis://10.0.0.3:6379"
    argv = ["--redis-url", f"{a},{b}", "--redis-url", c, "--redis-url", a]
    assert load(command, "p", argv, env={}).redis_url == (a, b, c)
    assert load(command, "p", [], env={"PEGAFLOW_REDIS_URL": f"{b},{a}"}).redis_url == (b, a)


@pytest.mark.parametrize("argv, needle", [
    (["--redis-url", "redis://a:1/0,redis://:pw@b:2/0"], "differs from 'redis://a:1/0' in more than HOST:PORT"),
    (["--redis-url", "redis://a:1/0,redis://b:2/1"], "in more than HOST:PORT"),
    (["--redis-url", "redis://a:1/0,rediss://b:2/0"], "in more than HOST:PORT"),
    (["--redis-url", "unix:///tmp/r.sock,redis://b:2/0"], "must be redis:// or rediss://"),
    (["--redis-url", "redis://a:1/0,http://b:2"], "invalid Redis URL"),
    # redis-py's ValueErrors when it reads the URL were tracebacks
    (["--redis-url", "redis://127.0.0.1:99999/0"], "redis://127.0.0.1:99999/0"),
    (["--redis-url", "redis://127.0.0.1:1/0?socket_timeout=abc"], "socket_timeout"),
    (["--redis-url", "redis://127.0.0.1:0/0"], "port must be in 1..65535"),  # redis-py: port 6379
    (["--redis-url", "redis://127.0.0.1:1/0?no_such_option=1"], "no_such_option"),  # a TypeError at connect
])
def test_seeds_that_one_client_cannot_share_are_refused_in_one_line(argv, needle):
    p = subprocess.run([sys.executable, "-m", "pegaflow.meta.cli", *argv], capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_the_originals_flag_names_and_log_levels_are_accepted():
    o = load(NODE, "pegaflow-server", ["--log-level", "warn", "--transfer-lock-timeout-secs", "120",
                                                "--metric-hll-windows", "15m,1d"], env={})
    assert o.log_level == "warning" and o.pin_ttl == 120.0 and o.ceiling_windows == (900.0, 86400.0)
    assert load(NODE, "n", ["--log-level", "trace"], env={}).log_level == "debug"


def test_each_command_config_has_exactly_the_table_options_in_order():
    import dataclasses

    for command, cls in CONFIGS.items():
        assert [f.name for f in dataclasses.fields(cls)] == field_names(command), command


def test_config_is_typed_and_frozen():
    import dataclasses

    c = load(NODE, "pegaflow-node", ["--nics", "a", "b"], env={})
    assert isinstance(c, NodeConfig) and c.nics == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.addr = "x:1"  # type: ignore[misc]
    assert node_config(pool_size=1 << 20).pool_size == 1 << 20


def _invocations() -> list[tuple[str, str | None]]:
    """Every command, and every subcommand of those that have some."""
    from pegaflow.config.options import SUBCOMMANDS

    return [(c, s) for c in sorted(CONFIGS) for s in ([n for n, _ in SUBCOMMANDS[c]] if c in SUBCOMMANDS else [None])]


def _minimal(command: str, subcommand: str | None) -> list[str]:
    """The shortest command line the (sub)command takes: a value for each positional argument
    and required option, and the first option of each one-of group."""
    from pegaflow.config.options import options_for

    argv, groups = ([subcommand] if subcommand else []), set()
    for o in options_for(command, subcommand):
        if o.positional:
            argv.append("trace.jsonl")
        elif o.required or (o.one_of and o.one_of not in groups):
            groups.add(o.one_of)
            argv += [f"--{o.name}", *([] if o.flag else ["x"])]
    return argv


@pytest.mark.parametrize("command, subcommand", _invocations())
def test_an_empty_value_counts_as_not_given_for_every_option(command: str, subcommand: str | None,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from pegaflow.config.options import options_for

    opts = options_for(command, subcommand)
    args = _minimal(command, subcommand)
    base = load(command, command, args, env={})
    checked = 0
    for o in opts:
        if o.positional:
            continue
        for var in o.envs:  # the variable and its aliases'
            assert load(command, command, args, env={var: ""}) == base, var
            assert load(command, command, args, env={var: "  "}) == base, var
        if not o.flag:  # a switch takes no value
            for name in (o.name, *o.aliases):
                if f"--{name}" in args:  # required: an empty value is no value
                    with pytest.raises(SystemExit) as stop:
                        load(command, command, [*args, f"--{name}="], env={})
                    assert stop.value.code == 2 and "required" in capsys.readouterr().err, name
                else:
                    assert load(command, command, [*args, f"--{name}="], env={}) == base, name
        checked += 1
    assert checked == len([o for o in opts if not o.positional]) > 0


@pytest.mark.parametrize("command, subcommand", _invocations())
def test_help_names_only_the_variables_that_are_read(command: str, subcommand: str | None) -> None:
    """``pegaflow replay --help`` said TRACE could be given as $PEGAFLOW_TRACE; it never was
    read (a positional argument is required on the command line)."""
    import re

    from pegaflow.config.options import build_parser, options_for

    parser = build_parser(command, command)
    if subcommand:
        parser = next(a for a in parser._actions if a.choices and subcommand in a.choices).choices[subcommand]  # noqa: SLF001
    actions = {a.dest: a for a in parser._actions}  # noqa: SLF001
    for o in options_for(command, subcommand):
        named = re.findall(r"\$(PEGAFLOW_\w+)", actions[o.dest].help or "")
        assert named == list(o.envs[:1]), (o.name, named)
        assert not (o.positional and named), (o.name, named)  # fill_defaults never reads one


def test_an_empty_flag_lets_the_environment_apply():
    o = load(NODE, "pegaflow-node", ["--pool-size="], env={"PEGAFLOW_POOL_SIZE": "2gb"})
    assert o.pool_size == 2 << 30


def test_an_empty_positional_argument_is_a_one_line_error():
    p = subprocess.run([sys.executable, "-m", "pegaflow.cli", "replay", ""], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "empty" in p.stderr, p.stderr


def test_metaserver_with_an_empty_redis_url_flag_uses_the_environment_and_says_one_line():
    # PEGAFLOW_REDIS_URL= used to end in a traceback (redis-py: "Redis URL must specify one of
    # the following schemes"); now an empty value is not given, so the next source applies.
    p = subprocess.run(
        [sys.executable, "-m", "pegaflow.meta.cli", "--redis-url=", "--addr", "127.0.0.1:0", "--http-addr", "off"],
        capture_output=True, text=True, timeout=60,
        env={"PEGAFLOW_REDIS_URL": "redis://127.0.0.1:1/0", "PATH": "/usr/bin:/bin"},
    )
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert len(lines) == 1 and "redis://127.0.0.1:1/0" in lines[0], p.stderr


# --- the original's complete flag lists (tests/original_flags.py) -----------------------------

def test_the_transcription_has_every_flag_of_the_originals_two_daemons_once():
    from tests import original_flags as of

    for flags, n in ((of.ORIGINAL_SERVER_FLAGS, 30), (of.ORIGINAL_METASERVER_FLAGS, 6),
                     (of.ORIGINAL_SERVER_FLAGS_0251, 34), (of.ORIGINAL_METASERVER_FLAGS_0251, 9)):
        names = [f for f, _ in flags]
        assert len(names) == len(set(names)) == n


RELEASES = [("node", "0.23.12"), ("meta", "0.23.12"), ("node", "0.25.1"), ("meta", "0.25.1")]


def _original_flags(command: str, release: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    from tests import original_flags as of

    return {("node", "0.23.12"): of.ORIGINAL_SERVER_FLAGS, ("meta", "0.23.12"): of.ORIGINAL_METASERVER_FLAGS,
            ("node", "0.25.1"): of.ORIGINAL_SERVER_FLAGS_0251,
            ("meta", "0.25.1"): of.ORIGINAL_METASERVER_FLAGS_0251}[(command, release)]


@pytest.mark.parametrize("command, release", RELEASES)
def test_every_flag_of_the_original_is_accepted_by_the_parser(command: str, release: str):
    from pegaflow.config.options import META, build_parser
    from tests.original_flags import PARSE_ONLY, argv

    flags = _original_flags(command, release)
    known = build_parser(command, command)._option_string_actions  # noqa: SLF001
    assert [f for f, _ in flags if f not in known] == []
    for flag, values in flags:  # each alone, with the original's syntax
        load(command, command, [flag, *(v.format(**PARSE_ONLY) for v in values)], env={})
    o = load(command, command, argv(flags, **PARSE_ONLY), env={})  # and all at once
    if command == META:
        assert (o.http_addr, o.node_stale_secs, o.ttl_minutes, o.sweep_interval) == ("127.0.0.1:9092", 20, 60, 600.0)
        if release == "0.25.1":
            assert (o.min_reclaimable_owner_count, o.enable_decode_backup, o.backup_target_delay_secs) == (2, True, 60)
        return
    assert o.devices == (0,) and o.hint_value_size == 256 << 10 and o.use_hugepages and o.enable_prometheus
    assert o.disable_numa_affinity and o.blockwise_alloc and o.enable_lfu_admission
    assert (o.ssd_cache_shards, o.ssd_write_queue_depth, o.ssd_prefetch_queue_depth) == (2, 4, 4)
    assert (o.ssd_write_inflight, o.ssd_prefetch_inflight, o.max_prefetch_blocks) == (4, 8, 100)
    assert (o.trace_sample_rate, o.pool_shards, o.qps_per_peer, o.metaserver_queue_depth) == (0.5, 2, 4, 1024)
    assert (o.metric_hll_bucket_bits, o.metrics_period_secs, o.pin_ttl) == (14, 1, 120.0)
    assert o.nics == ("mlx5_0", "mlx5_1") and o.metaserver_addr == "127.0.0.1:50056"
    if release == "0.25.1":
        assert (o.backup_reclaimable_percent, o.backup_max_candidates) == (20, 4096)
        assert (o.backup_pull_max_bytes, o.backup_max_bandwidth) == (64 << 20, 1 << 30)


def test_the_new_flags_default_to_the_originals_values():
    from pegaflow.config.options import META

    o = load(NODE, "pegaflow-server", [], env={})
    assert o.devices == () and o.hint_value_size == 0 and o.enable_prometheus is True
    assert (o.ssd_cache_shards, o.ssd_write_queue_depth, o.ssd_prefetch_queue_depth) == (1, 8, 2)
    assert (o.ssd_write_inflight, o.ssd_prefetch_inflight, o.max_prefetch_blocks) == (2, 16, 800)
    assert (o.trace_sample_rate, o.pool_shards, o.blockwise_alloc, o.qps_per_peer) == (1.0, 1, False, 2)
    assert (o.metaserver_queue_depth, o.metric_hll_bucket_bits, o.metrics_period_secs) == (4096, 16, 10)
    assert (o.backup_reclaimable_percent, o.backup_max_candidates) == (10, 16384)
    assert (o.backup_pull_max_bytes, o.backup_max_bandwidth) == (256 << 20, 2 << 30)
    m = load(META, "pegaflow-metaserver", [], env={})
    assert (m.http_addr, m.node_stale_secs, m.ttl_minutes) == ("127.0.0.1:9092", 30, 120)
    assert (m.min_reclaimable_owner_count, m.enable_decode_backup, m.backup_target_delay_secs) == (3, False, 180)


def test_the_metaservers_decode_backup_flags_read_the_originals_variables():
    from pegaflow.config.options import META

    env = {"PEGAFLOW_METASERVER_MIN_RECLAIMABLE_OWNER_COUNT": "5", "PEGAFLOW_METASERVER_ENABLE_DECODE_BACKUP": "true"}
    m = load(META, "pegaflow-metaserver", [], env=env)
    assert (m.min_reclaimable_owner_count, m.enable_decode_backup) == (5, True)


def test_ttl_minutes_takes_the_originals_whole_minutes_and_fractions():
    from pegaflow.config.options import META

    assert load(META, "m", ["--ttl-minutes", "90"], env={}).ttl_minutes == 90
    assert load(META, "m", ["--ttl-minutes", "0.5", "--node-stale-secs", "20"], env={}).ttl_minutes == 0.5


@pytest.mark.parametrize("argv, want", [(["--devices", "0,1,3"], (0, 1, 3)), (["--devices", "0", "--devices", "2"], (0, 2))])
def test_devices_take_the_originals_comma_list_or_the_flag_repeated(argv, want):
    assert load(NODE, "n", argv, env={}).devices == want


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--devices", "-1"], "--devices"),
        (["--trace-sample-rate", "1.5"], "between 0.0 and 1.0"),
        (["--metric-hll-bucket-bits", "19"], "4..=18"),
        (["--metric-hll-bucket-bits", "3"], "4..=18"),
        (["--ssd-cache-shards", "0"], "--ssd-cache-shards"),
        (["--hint-value-size", "-5"], "--hint-value-size"),
        (["--enable-prometheus", "false"], "unrecognized arguments: false"),  # a clap switch takes no value
        (["--backup-max-candidates", "0"], "must be in 1..=65536, got 0"),
        (["--backup-max-candidates", "65537"], "must be in 1..=65536, got 65537"),
        (["--backup-reclaimable-percent", "101"], "101 is not in 0..=100"),
        (["--backup-reclaimable-percent", "12.5"], "--backup-reclaimable-percent"),
        (["--backup-pull-max-bytes", "0"], "must be greater than 0"),
        (["--backup-max-bandwidth", "lots"], "--backup-max-bandwidth"),
        (["--liveness-ttl", "0"], "--liveness-ttl"),  # ours: a live key Redis cannot set (PX 0)
    ],
)
def test_the_originals_flags_reject_what_the_original_rejects_in_one_line(argv, needle):
    p = forked.run([sys.executable, "-m", "pegaflow.node.cli", *argv])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("argv, needle", [(["--ttl-minutes", "0"], "--ttl-minutes"),
                                          (["--ttl-minutes", "1", "--node-stale-secs", "61"], "must cover"),
                                          (["--min-reclaimable-owner-count", "1"], "must be at least 2"),
                                          (["--backup-target-delay-secs", "-1"], "--backup-target-delay-secs"),
                                          (["--enable-decode-backup", "true"], "unrecognized arguments: true"),
                                          # a lease Redis cannot set (PX 0): the consumer applied nothing
                                          (["--stream-lease-ttl", "0"], "--stream-lease-ttl")])
def test_metaserver_lifecycle_flags_are_checked_like_the_originals(argv, needle):
    p = subprocess.run([sys.executable, "-m", "pegaflow.meta.cli", *argv], capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_only_options_without_effect_set_away_from_their_defaults_are_reported():
    from pegaflow.config.options import META, options_for, without_effect
    from tests.original_flags import (
        ORIGINAL_METASERVER_FLAGS_0251,
        ORIGINAL_SERVER_FLAGS_0251,
        PARSE_ONLY,
        argv,
    )

    assert without_effect(NODE, load(NODE, "n", [], env={})) == []
    for command, flags in ((NODE, ORIGINAL_SERVER_FLAGS_0251), (META, ORIGINAL_METASERVER_FLAGS_0251)):
        got = [f for f, _ in without_effect(command, load(command, "n", argv(flags, **PARSE_ONLY), env={}))]
        assert got == [f"--{o.name}" for o in options_for(command) if o.no_effect], command
    # the implemented ones are never reported
    implemented = {"--max-prefetch-blocks", "--trace-sample-rate", "--hint-value-size", "--metrics-period-secs",
                   "--enable-prometheus", "--ttl-minutes", "--ssd-cache-shards"}
    assert not implemented & {f"--{o.name}" for o in options_for(NODE) + options_for(META) if o.no_effect}


def test_options_without_effect_say_so_in_their_help_and_only_they():
    from pegaflow.config.options import OPTIONS

    for o in OPTIONS:
        assert bool(o.no_effect) == ("accepted for compatibility" in o.help), o.name


def _bounded() -> list[tuple[str, object]]:
    from pegaflow.config.options import OPTIONS, Bounded

    return [(c, o) for o in OPTIONS if isinstance(o.parse, Bounded) and not o.positional for c in o.commands]


@pytest.mark.parametrize("command, opt", _bounded(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_every_bounded_option_refuses_a_value_outside_its_range_naming_the_option_and_the_range(
        command: str, opt, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    from pegaflow.config.options import SUBCOMMANDS

    bad = opt.parse.outside()
    subcommand = (opt.subcommands or [n for n, _ in SUBCOMMANDS.get(command, ())] or [None])[0]
    args = _minimal(command, subcommand)  # a command's required arguments
    tries = [([*args, f"--{opt.name}", bad], {}, f"--{opt.name}")]
    tries += [(args, {opt.env: bad}, opt.env)] if opt.envs else []
    for argv, env, name in tries:
        with pytest.raises(SystemExit) as stop:
            load(command, "prog", argv, env=env)
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and len(err.splitlines()) == 1, err
        assert name in err and opt.parse.refusal(opt.parse.kind(bad)) in err, err
    # and a value inside the range is taken
    inside = opt.parse.lo if opt.parse.lo is not None and not opt.parse.lo_open else opt.parse.hi or 1
    assert opt.parse(str(inside)) == opt.parse.kind(inside)


# Every spelling of a number that is not finite that float() (and so a parser) might take.
NON_FINITE = ("nan", "NaN", "-nan", "inf", "+inf", "-inf", "Infinity", "1e400", "9" * 400, "nan%", "inf%",
              "9" * 400 + "%", "9" * 400 + "blocks", "9" * 400 + "s", "9" * 400 + "gb", "15m,nan", "x=nan")
# The options where inf is a value, and its one spelling: a replay tier's 'inf' (nothing is
# ever evicted; config/capacity.py).
INF_ALLOWED = {"l1-capacity": "inf", "ssd-capacity": "inf", "sweep": "inf"}


def _floats(value: object) -> list[float]:
    """The floats a parsed value holds (in a list, a tuple, a dataclass's fields)."""
    import dataclasses

    if isinstance(value, float):
        return [value]
    if isinstance(value, list | tuple):
        return [f for v in value for f in _floats(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [f for fl in dataclasses.fields(value) for f in _floats(getattr(value, fl.name))]
    return []


def _valued() -> list[tuple[str, object]]:
    from pegaflow.config.options import OPTIONS

    return [(c, o) for o in OPTIONS if not (o.positional or o.flag) for c in o.commands]


@pytest.mark.parametrize("command, opt", _valued(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_no_option_takes_nan_and_only_a_replay_tier_takes_inf(command: str, opt,  # noqa: ANN001
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """nan passed every range check (comparisons with it are false) and inf every open upper
    bound: a daemon then failed at int(inf), slept forever under a lock or answered INTERNAL."""
    import math

    from pegaflow.config.options import SUBCOMMANDS

    subcommand = (opt.subcommands or [n for n, _ in SUBCOMMANDS.get(command, ())] or [None])[0]
    args = _minimal(command, subcommand)
    if f"--{opt.name}" in args:  # a required option: give it the value instead of 'x'
        i = args.index(f"--{opt.name}")
        del args[i:i + 2]
    for text in NON_FINITE:
        try:
            value = getattr(load(command, "prog", [*args, f"--{opt.name}", text], env={}), opt.dest)
        except SystemExit as stop:
            err = capsys.readouterr().err.strip()
            assert stop.code == 2 and len(err.splitlines()) == 1 and f"--{opt.name}" in err, (text, err)
            continue
        bad = [f for f in _floats(value) if math.isnan(f) or (math.isinf(f) and INF_ALLOWED.get(opt.name) != text)]
        assert not bad, (opt.name, text, value)


def test_a_cost_of_two_is_refused_as_a_cost_not_as_a_sample_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """Two parsers had one name; the second (the trace sample rate's) won, so every other
    fraction was refused in the sample rate's words."""
    from pegaflow.config.options import REPLAY

    with pytest.raises(SystemExit):
        load(REPLAY, "pegaflow replay", ["t.jsonl", "--ssd-hit-cost", "2"], env={})
    err = capsys.readouterr().err
    assert "--ssd-hit-cost" in err and "must be in [0, 1], got 2.0" in err and "sample rate" not in err


# --- pegaflow cache: subcommands in the table ------------------------------------------------

def test_every_rows_subcommands_are_its_commands_and_a_one_of_group_shares_its_subcommands():
    from pegaflow.config.options import OPTIONS, SUBCOMMANDS

    groups: dict[tuple[str, str], set[tuple[str, ...]]] = {}
    for o in OPTIONS:
        for c in o.commands:
            assert set(o.subcommands) <= {n for n, _ in SUBCOMMANDS.get(c, ())}, (o.name, c)
            if o.one_of:
                groups.setdefault((c, o.one_of), set()).add(o.subcommands)
        assert not (o.one_of and o.required), o.name
    assert all(len(subs) == 1 for subs in groups.values()), groups


def test_cache_reads_the_node_address_from_pegaflow_addr_and_its_flags_from_the_table():
    from pegaflow.config.commands import CacheConfig
    from pegaflow.config.options import CACHE
    from pegaflow.core.hosts import NODE_ADDR

    c = load(CACHE, "pegaflow cache", ["pin", "-n", "ns", "--hashes", "aa,bb", "cc", "--name", "sys"], env={})
    assert isinstance(c, CacheConfig) and c.addr == NODE_ADDR and c.timeout == 10.0
    assert (c.subcommand, c.namespace, c.hashes, c.name, c.all, c.id) == ("pin", "ns", ("aa", "bb", "cc"), "sys",
                                                                          False, "")
    c = load(CACHE, "pegaflow cache", ["unpin", "sys"], env={"PEGAFLOW_ADDR": "10.0.0.1:7000"})
    assert (c.subcommand, c.id, c.addr) == ("unpin", "sys", "10.0.0.1:7000")
    assert load(CACHE, "c", ["pins", "--addr", "h:1"], env={"PEGAFLOW_ADDR": "10.0.0.1:7000"}).addr == "h:1"


def test_what_a_cache_command_acts_on_is_never_read_from_the_environment():
    from pegaflow.config.options import CACHE

    env = {"PEGAFLOW_NAMESPACE": "ns", "PEGAFLOW_ALL": "1", "PEGAFLOW_JSON": "1", "PEGAFLOW_TIMEOUT": "1"}
    c = load(CACHE, "pegaflow cache", ["clear", "--instance", "engine-7"], env=env)
    assert (c.namespace, c.all, c.instance, c.json, c.timeout) == ("", False, "engine-7", False, 10.0)


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([], "required: subcommand"),
        (["inspect", "--tokens", "1"], "required: --namespace/-n"),
        (["pin", "-n", "ns"], "one of the arguments --tokens --tokens-file --hashes is required"),
        (["inspect", "-n", "ns", "--tokens", "1", "--hashes", "aa"], "--hashes: not allowed with argument --tokens"),
        (["clear"], "one of the arguments --namespace --instance --all is required"),
        (["clear", "--all", "-n", "ns"], "--all: not allowed with argument --namespace/-n"),
        (["clear", "--namespace="], "required"),
        (["unpin"], "required: ID"),
        (["pins", "--timeout", "0"], "--timeout"),
        (["pins", "--addr", "nowhere"], "--addr"),
        (["pins", "--namespace", "ns"], "unrecognized arguments"),
    ],
)
def test_bad_cache_arguments_exit_2_with_one_line(argv: list[str], needle: str) -> None:
    p = forked.run([sys.executable, "-m", "pegaflow.cli", "cache", *argv])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("pegaflow cache"), p.stderr


def test_the_readme_names_every_default_that_differs_from_the_originals() -> None:
    """README.md says which of the original's flags have another default here (and why);
    every other default is the original's (0.25.1's --help, tests/original_flags.py)."""
    from pegaflow.config.options import META, NODE, default_of, options_for
    from tests.original_flags import ORIGINAL_DEFAULTS

    differ = set()
    for (command, flag), text in ORIGINAL_DEFAULTS.items():
        opt = next(o for o in options_for(NODE if command == "node" else META) if flag in o.flags)
        if opt.parse(text) != default_of(opt):
            differ.add(flag)
    readme = (ROOT / "README.md").read_text()
    bullet = readme[readme.index("Defaults that differ from the original's"):]
    bullet = bullet[:bullet.index("\n- ")]
    assert differ and {f for f in differ if f"`{f}`" in bullet} == differ, (differ, bullet)
