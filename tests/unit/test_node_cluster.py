"""How a node given only --metaserver-addr finds the Redis to publish to (pegaflow/node/discovery.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from pegaflow.common.security import Security
from pegaflow.node import discovery as cluster


@pytest.mark.parametrize(
    "url, meta, want",
    [
        ("redis://127.0.0.1:6379/0", "10.0.0.100:50056", "redis://10.0.0.100:6379/0"),
        ("redis://localhost:6379/0", "meta.example:50056", "redis://meta.example:6379/0"),
        ("redis://0.0.0.0:7000", "10.0.0.100:50056", "redis://10.0.0.100:7000"),
        ("redis://:secret@127.0.0.1:6379/2", "10.0.0.100:50056", "redis://:secret@10.0.0.100:6379/2"),
        ("rediss://127.0.0.1:6380/0", "[fd00::1]:50056", "rediss://[fd00::1]:6380/0"),
        ("redis://10.0.0.1:6379/0", "10.0.0.100:50056", "redis://10.0.0.1:6379/0"),  # routable: kept
        ("redis://127.0.0.1:6379/0", "127.0.0.1:50056", "redis://127.0.0.1:6379/0"),  # same host
        ("unix:///run/redis.sock", "10.0.0.100:50056", "unix:///run/redis.sock"),
    ],
)
def test_a_local_redis_host_means_the_metaservers_host(url, meta, want):
    assert cluster.as_seen_from(url, meta) == want


def test_passwords_stay_out_of_logs():
    assert cluster.redacted("redis://:secret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert cluster.redacted("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert cluster.redacted("redis://h:1/0") == "redis://h:1/0"


class _Meta(meta_pb2_grpc.MetaServiceServicer):
    def __init__(self, url: str) -> None:
        self.url = url
        self.calls = 0

    async def GetClusterConfig(self, request, context):  # noqa: N802
        self.calls += 1
        return meta_pb2.ClusterConfigResponse(redis_url=self.url, redis_cluster=True)


def test_discover_keeps_asking_until_the_metaserver_answers():
    async def run() -> tuple[cluster.RedisTarget, int]:
        server = grpc.aio.server()
        servicer = _Meta("redis://127.0.0.1:6379/0")
        meta_pb2_grpc.add_MetaServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        addr = f"localhost:{port}"
        task = asyncio.create_task(cluster.discover(addr, Security(), retry_max=0.05))
        await asyncio.sleep(0)  # the first attempts fail: nothing listens yet
        for _ in range(200):
            if task.done():
                break
            await asyncio.sleep(0.005)
        assert not task.done(), "answered before the metaserver existed"
        await server.start()
        target = await asyncio.wait_for(task, 10)
        await server.stop(None)
        return target, servicer.calls

    target, calls = asyncio.run(run())
    assert target == cluster.RedisTarget(("redis://127.0.0.1:6379/0",), True)  # localhost: the same host
    assert calls == 1


def test_a_metaservers_several_seeds_arrive_comma_separated_and_are_each_the_nodes():
    async def run() -> cluster.RedisTarget:
        server = grpc.aio.server()
        meta_pb2_grpc.add_MetaServiceServicer_to_server(_Meta("redis://127.0.0.1:7000/0,redis://10.0.0.7:7001/0"),
                                                        server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await cluster.ask(f"localhost:{port}", Security())
        finally:
            await server.stop(None)

    assert asyncio.run(run()) == cluster.RedisTarget(("redis://127.0.0.1:7000/0", "redis://10.0.0.7:7001/0"), True)
