from batchgen.engine.block_manager import BlockManager
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.step import ScheduledSeq
from batchgen.engine.sequence import Sequence, SequenceStatus
from batchgen.sampling_params import SamplingParams

OUTPUT_TOKEN = 7


def make_seq(token_ids: list[int], request_id: int = 0) -> Sequence:
    return Sequence(request_id, token_ids, SamplingParams(max_tokens=64), arrival_time=0.0)


def make_scheduler(num_blocks: int, block_size: int = 16, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                   enable_prefix_caching: bool = True) -> Scheduler:
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def run_step(scheduler: Scheduler) -> list[ScheduledSeq]:
    """Schedule one step and pretend the model ran it: sampling sequences get one new token."""
    step = scheduler.schedule()
    sampling = step.sampling_seqs
    for item in step.seqs:
        assert len(item.seq.block_table) * scheduler.block_manager.block_size >= (
            item.seq.num_computed_tokens + item.num_new_tokens
        )
    scheduler.postprocess(step)
    for seq in sampling:
        seq.token_ids.append(OUTPUT_TOKEN)
    return step.seqs


def work(scheduled: list[ScheduledSeq]) -> list[tuple[int, int]]:
    return [(item.seq.request_id, item.num_new_tokens) for item in scheduled]


def test_token_budget_is_respected():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=50)
    for request_id in range(4):
        scheduler.add(make_seq([1000 * request_id + i for i in range(20)], request_id))
    steps = [work(run_step(scheduler)) for _ in range(3)]
    assert steps[0] == [(0, 20), (1, 20), (2, 10)]
    assert steps[1] == [(0, 1), (1, 1), (2, 10), (3, 20)]
    assert steps[2] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    for step in steps:
        assert sum(num_new for _, num_new in step) <= 50


def test_long_prompt_is_chunked_over_several_steps():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=32)
    seq = make_seq(list(range(80)))
    scheduler.add(seq)
    chunks = []
    for _ in range(3):
        scheduled = run_step(scheduler)
        assert len(scheduled) == 1
        chunks.append((scheduled[0].num_new_tokens, len(seq)))
    assert chunks == [(32, 80), (32, 80), (16, 81)]  # only the last chunk samples a token
    assert seq.num_computed_tokens == 80
    assert len(seq) == 81
    assert seq.block_table == [0, 1, 2, 3, 4]
    assert work(run_step(scheduler)) == [(0, 1)]
    assert seq.num_computed_tokens == 81


def test_max_num_seqs_is_respected():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    seqs = [make_seq([100 * i + j for j in range(5)], i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert work(run_step(scheduler)) == [(0, 5), (1, 5)]
    assert work(run_step(scheduler)) == [(0, 1), (1, 1)]
    assert list(scheduler.waiting) == [seqs[2]]
    assert seqs[2].status is SequenceStatus.WAITING
    scheduler.finish(seqs[0])
    assert work(run_step(scheduler)) == [(1, 1), (2, 5)]


def test_running_sequences_are_scheduled_before_waiting_ones():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=20)
    scheduler.add(make_seq(list(range(10)), 0))
    assert work(run_step(scheduler)) == [(0, 10)]
    scheduler.add(make_seq(list(range(100, 130)), 1))
    # The decode token of the running sequence comes first and comes out of the same budget.
    assert work(run_step(scheduler)) == [(0, 1), (1, 19)]
    assert work(run_step(scheduler)) == [(0, 1), (1, 11)]


def test_shared_uncached_prefix_is_computed_once():
    scheduler = make_scheduler(num_blocks=64)
    prefix = list(range(48))  # 3 blocks of 16
    seqs = [make_seq(prefix + [1000 + 10 * i + j for j in range(5)], i) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    assert work(run_step(scheduler)) == [(0, 53)]
    assert list(scheduler.waiting) == seqs[1:]
    assert work(run_step(scheduler)) == [(0, 1), (1, 5), (2, 5), (3, 5)]
    assert [seq.metrics.num_cached_tokens for seq in seqs] == [0, 48, 48, 48]
    assert [seq.block_table[:3] for seq in seqs] == [[0, 1, 2]] * 4
    assert [scheduler.block_manager.blocks[i].ref_count for i in range(3)] == [4, 4, 4]


def test_shared_prefix_longer_than_a_chunk_is_computed_once():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=48)
    prefix = list(range(64))  # 4 blocks of 16
    other = make_seq(list(range(500, 516)), 0)
    first = make_seq(prefix + [1000, 1001], 1)
    second = make_seq(prefix + [2000, 2001], 2)
    for seq in (other, first, second):
        scheduler.add(seq)
    second_steps = []
    for _ in range(4):
        second_steps += [num_new for request_id, num_new in work(run_step(scheduler)) if request_id == 2]
    # The second sequence waits while the first computes the 4 prefix blocks (over two steps),
    # then reuses all of them: it prefills only its 2-token tail, then decodes.
    assert second_steps == [2, 1]
    assert second.metrics.num_cached_tokens == 64
    assert second.block_table[:4] == first.block_table[:4]


def test_newest_running_sequence_is_preempted_when_the_pool_is_full():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    seqs = [make_seq([100 * i + j for j in range(4)], i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert work(run_step(scheduler)) == [(0, 4), (1, 4), (2, 4)]
    assert [seq.block_table for seq in seqs] == [[0], [1], [2]]
    # Each sequence now needs a second block; only one is free.
    assert work(run_step(scheduler)) == [(0, 1), (1, 1)]
    assert scheduler.num_preemptions == 1
    assert scheduler.running == seqs[:2]
    assert list(scheduler.waiting) == [seqs[2]]
    assert seqs[2].status is SequenceStatus.WAITING
    assert seqs[2].block_table == [] and seqs[2].num_computed_tokens == 0
    assert seqs[2].token_ids == [200, 201, 202, 203, OUTPUT_TOKEN]
    assert seqs[0].block_table == [0, 3]
    assert seqs[1].block_table == [1, 2]  # the preempted sequence's block, evicted
    assert scheduler.block_manager.num_evictions == 1


def test_preempted_sequence_goes_to_the_front_of_waiting():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=3)
    seqs = [make_seq([100 * i + j for j in range(4)], i) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler)
    assert list(scheduler.waiting) == [seqs[3]]
    run_step(scheduler)
    assert list(scheduler.waiting) == [seqs[2], seqs[3]]


def decode_until_preempted(scheduler: Scheduler, old: Sequence, new: Sequence) -> None:
    """Two 4-token prompts in a 6-block pool (block size 4) decode until the pool runs out."""
    scheduler.add(old)
    scheduler.add(new)
    for _ in range(9):  # prefill, then decode positions 4..11: 3 blocks each, the pool is full
        run_step(scheduler)
    assert (old.num_computed_tokens, new.num_computed_tokens) == (12, 12)
    assert scheduler.block_manager.num_free_blocks == 0
    assert scheduler.num_preemptions == 0
    assert work(run_step(scheduler)) == [(0, 1)]  # old needs a 4th block: new is preempted
    assert scheduler.num_preemptions == 1
    assert scheduler.running == [old]
    assert list(scheduler.waiting) == [new]
    assert new.status is SequenceStatus.WAITING
    assert new.block_table == [] and new.num_computed_tokens == 0


def test_preempted_sequence_recomputes_prompt_and_outputs():
    scheduler = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    old, new = make_seq(list(range(4)), 0), make_seq(list(range(100, 104)), 1)
    decode_until_preempted(scheduler, old, new)
    assert len(new) == 13  # 4 prompt + 9 output tokens
    scheduler.finish(old)
    assert work(run_step(scheduler)) == [(1, 13)]
    assert new.num_computed_tokens == 13
    assert len(new) == 14


def test_preempted_sequence_reuses_its_cached_blocks():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    old, new = make_seq(list(range(4)), 0), make_seq(list(range(100, 104)), 1)
    decode_until_preempted(scheduler, old, new)
    # old took the evicted deepest block of new; new's first two blocks are still cached.
    assert scheduler.block_manager.num_evictions == 1
    assert len(new) == 13
    scheduler.finish(old)
    assert work(run_step(scheduler)) == [(1, 13 - 8)]
    assert new.num_computed_tokens == 13
    assert new.metrics.num_cached_tokens == 0  # counted at first admission only


def test_forked_samples_count_against_max_num_seqs():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    parent = Sequence(0, list(range(20)), SamplingParams(n=4, max_tokens=8), arrival_time=0.0)
    later = make_seq(list(range(100, 110)), 1)
    scheduler.add(parent)
    scheduler.add(later)
    assert work(run_step(scheduler)) == [(0, 20), (1, 10)]
    children = [parent.fork(index, None) for index in (1, 2, 3)]
    for child in children[:2]:  # no slot left: they wait, first in line, with nothing computed
        scheduler.fork(parent, child)
    assert scheduler.running == [parent, later]
    assert list(scheduler.waiting) == [children[1], children[0]]
    assert all(child.status is SequenceStatus.WAITING and child.num_computed_tokens == 0 for child in children[:2])
    scheduler.finish(later)
    scheduler.fork(parent, children[2])  # a slot is free: it runs on the parent's blocks
    assert scheduler.running == [parent, children[2]]
    assert children[2].block_table[0] == parent.block_table[0]
