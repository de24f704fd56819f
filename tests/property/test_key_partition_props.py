"""The partition an outbox relay gives a keyed record (budgetgate.messaging.publisher.partition_of,
its hash kept across relays) is the one aiokafka's default partitioner, and so the Java client,
gives it: a run's usage records stay on one partition, in order, whoever sends them."""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st

from budgetgate.messaging.publisher import key_hash, partition_of

partition_lists = st.lists(st.integers(0, 4096), min_size=1, max_size=64, unique=True).map(sorted)


@given(st.binary(max_size=200), partition_lists)
def test_a_key_goes_where_the_default_partitioner_sends_it(key: bytes, partitions: list[int]) -> None:
    expected = DefaultPartitioner()(key, partitions, partitions)
    assert partition_of(key, partitions) == expected
    assert partition_of(key, partitions) == expected  # from the kept hash, the same


def test_kafka_murmur2_vectors() -> None:
    # org.apache.kafka.common.utils.UtilsTest.testMurmur2: "21" hashes to -973932308, "foobar"
    # to -790332482 (as Java ints); the partitioner takes the positive part.
    assert key_hash(b"21") == -973932308 & 0x7FFFFFFF
    assert key_hash(b"foobar") == -790332482 & 0x7FFFFFFF
