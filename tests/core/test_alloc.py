"""The allocation grammar: every example of the seeds and every rule, good and bad."""

import pytest

from archon.alloc import AllocationError, AllocationMode, ModelAllocation, ParallelStrategy, allocation_rows

# (string, world size, expected strategy fields) - every single-component example in the seeds.
SEED_COMPONENTS = [
    ("fsdp:d8", 8, dict(dp_size=8)),
    ("sglang:d2t4", 8, dict(dp_size=2, tp_size=4)),
    ("megatron:d2p2t4", 16, dict(dp_size=2, pp_size=2, tp_size=4)),
    ("megatron:d2p2t4e4", 16, dict(dp_size=2, pp_size=2, tp_size=4, ep_size=4)),
    ("fsdp:d4t2", 8, dict(dp_size=4, tp_size=2)),
    ("sglang:d4t2", 8, dict(dp_size=4, tp_size=2)),
    ("fsdp:d8t2", 16, dict(dp_size=8, tp_size=2)),
    ("archon:d8t2", 16, dict(dp_size=8, tp_size=2)),
    ("megatron:d2t4p2c2", 32, dict(dp_size=2, tp_size=4, pp_size=2, cp_size=2)),
    ("megatron:t4", 4, dict(tp_size=4)),
    ("megatron:d4", 4, dict(dp_size=4)),
    ("fsdp:d4", 4, dict(dp_size=4)),
    ("sglang:d4", 4, dict(dp_size=4)),
    ("sglang:d4t4", 16, dict(dp_size=4, tp_size=4)),
    ("archon:d4", 4, dict(dp_size=4)),
    ("archon:d4p2t2", 16, dict(dp_size=4, pp_size=2, tp_size=2)),
    ("archon:d2p2", 4, dict(dp_size=2, pp_size=2)),
    ("vllm:d2t4", 8, dict(dp_size=2, tp_size=4)),
    (
        "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
        32,
        dict(dp_size=4, pp_size=2, tp_size=2, cp_size=2, ep_size=2, etp_size=4),
    ),
    ("megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)", 16, dict(pp_size=4, tp_size=2, cp_size=2, ep_size=4, etp_size=1)),
    ("archon:(attn:d1p4t2c2|ffn:d1p4t1e4)", 16, dict(pp_size=4, tp_size=2, cp_size=2, ep_size=4, etp_size=1)),
]

# Every chain in the seeds, with total / inference / training world sizes.
SEED_CHAINS = [
    ("sglang:d4+fsdp:d4", 8, 4, 4),
    ("sglang:d4+megatron:d4", 8, 4, 4),
    ("sglang:d4+megatron:t4", 8, 4, 4),
    ("sglang:d4t4+megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)", 32, 16, 16),
    ("sglang:d4t4+archon:d4", 20, 16, 4),
    ("sglang:d2t4+fsdp:d4t2", 16, 8, 8),
    ("sglang:d4t2+archon:d4p2t2", 24, 8, 16),
    ("sglang:d4t4+archon:(attn:d1p4t2c2|ffn:d1p4t1e4)", 32, 16, 16),
]


@pytest.mark.parametrize("text, world, fields", SEED_COMPONENTS, ids=[c[0] for c in SEED_COMPONENTS])
def test_seed_examples(text, world, fields):
    alloc = ModelAllocation.from_str(text)
    assert alloc.world_size == world
    assert alloc.parallel == ParallelStrategy(**fields)
    assert alloc.backend == text.split(":")[0]
    assert ModelAllocation.from_str(str(alloc)) == alloc


def test_seed_memory_appendix_example_is_rejected_with_the_fix():
    # The Archon document's appendix suggests 'archon:d1p2e2' as the EP version of 'archon:d2p2'.
    # Under its own rule (e borrows ranks inside one pipeline stage, world = d*t*p*c) that string
    # has 1 rank per stage, which cannot hold 2 expert shards; the layout it means keeps the 4
    # ranks of d2p2: 'archon:d2p2e2'.  The error says exactly that.
    with pytest.raises(AllocationError, match=r"e2 must divide d\*c\*t = 1.*'archon:d2p2e2' \(4 ranks\)"):
        ModelAllocation.from_str("archon:d1p2e2")
    assert ModelAllocation.from_str("archon:d2p2e2").world_size == 4


def test_seed_hybrid_table():
    # The seeds' table for megatron:(attn:d4p2t2c2|ffn:d2p2t4e2).
    alloc = ModelAllocation.from_str("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)")
    assert (alloc.parallel.dp_size, alloc.parallel.pp_size, alloc.parallel.tp_size, alloc.parallel.cp_size) == (
        4,
        2,
        2,
        2,
    )
    assert alloc.ffn is not None
    assert (alloc.ffn.dp_size, alloc.ffn.pp_size, alloc.ffn.tp_size, alloc.ffn.ep_size) == (2, 2, 4, 2)
    assert alloc.world_size == 32 and alloc.is_hybrid


@pytest.mark.parametrize("text, world, gen, train", SEED_CHAINS, ids=[c[0] for c in SEED_CHAINS])
def test_seed_chains(text, world, gen, train):
    mode = AllocationMode.from_str(text)
    assert (mode.world_size, mode.gen_world_size, mode.train_world_size) == (world, gen, train)
    assert mode.gen is not None and mode.train is not None
    assert mode.gen.world_size == gen and mode.train.world_size == train
    assert AllocationMode.from_str(str(mode)) == mode


@pytest.mark.parametrize(
    "text, expected",
    [
        ("archon:t2d4", "archon:d4t2"),  # any order
        ("archon:c2e2d2", "archon:d2c2e2"),
        (" archon : d2 t2 ", "archon:d2t2"),  # whitespace
        ("archon:d1", "archon:d1"),
        ("local:d3", "local:d3"),
        ("vllm:d1t2p2", "vllm:d1p2t2"),
        ("fsdp:c2t2", "fsdp:d1t2c2"),
        ("archon:(attn:d2t2|ffn:e4)", "archon:(attn:d2p1t2|ffn:d1p1t1e4)"),  # ffn d derived: 4 / (1*1*4)
        ("archon:(attn:p2d2t2|ffn:t2e2)", "archon:(attn:d2p2t2|ffn:d1p2t2e2)"),  # ffn inherits p
        ("archon:( attn : d1p4t2c2 | ffn : d1p4t1e4 )", "archon:(attn:d1p4t2c2|ffn:d1p4t1e4)"),
        ("archon[actor]:d4", "archon[actor]:d4"),
    ],
)
def test_good_strings_canonicalise(text, expected):
    assert str(ModelAllocation.from_str(text)) == expected


def test_plain_form_has_etp_one_and_local_backend():
    a = ModelAllocation.from_str("archon:d2t2e4")
    assert a.parallel.ep_size == 4 and a.parallel.etp_size == 1 and a.world_size == 4 and a.ffn is None
    local = ModelAllocation.from_str("local:d2")
    assert local.is_inference and local.world_size == 2


def test_named_components_and_lookup():
    mode = AllocationMode.from_str("sglang[rollout]:d2 + archon[actor]:d4 + archon[critic]:d2t2")
    assert mode["rollout"].world_size == 2 and mode["critic"].parallel.tp_size == 2
    assert mode.gen is not None and mode.gen.backend == "sglang"
    assert mode.world_size == 10
    with pytest.raises(AllocationError, match="2 training components"):
        _ = mode.train
    with pytest.raises(KeyError, match="no component named 'ref'"):
        _ = mode["ref"]
    two = AllocationMode.from_str("sglang[gen]:d2+archon:d2")
    assert two.train is not None and two.train.world_size == 2 and two["gen"].is_inference


# (string, fragment the message must contain); every message must quote the string.
BAD = [
    ("", "empty"),
    ("   ", "empty"),
    ("d4t2", "'archon:d4t2' for training"),
    ("t2", "backend prefix is required"),
    ("sglang.d2t2p1+d1t4p1", "write 'sglang:d2t2+archon:d1t4p1'"),
    ("sglang.d4p2+d4", "'vllm:d4p2+archon:d4'"),
    ("sglang:d2+d4", "'d4' has no backend"),
    ("archn:d4", "did you mean 'archon'"),
    ("pytorch:d4", "known backends are sglang, vllm, local, inprocess, fsdp, megatron, archon"),
    ("archon:d4x2", "'x' is not a dimension"),
    ("archon:d", "dimension 'd' has no size"),
    ("archon:d0", "size 0"),
    ("archon:d2d2", "appears twice"),
    ("archon:", "has no dims"),
    ("archon d4", "not followed by ':'"),
    ("sglang:d2c2", "context parallel 'c' is not supported by backend 'sglang'"),
    ("sglang:d2p2", "use 'vllm:' for pipeline parallel"),
    ("fsdp:d2p2", "use 'archon:'"),
    ("fsdp:d4e2", "expert parallel 'e' is not supported by backend 'fsdp'"),
    ("local:t2", "local accepts d"),
    ("vllm:d2c2", "vllm accepts d, t, p"),
    ("archon:d2e3", "must divide d*c*t = 2"),
    ("archon:p4e2", "must divide d*c*t = 1"),
    ("fsdp:(attn:d2|ffn:e2)", "does not take the (attn:...|ffn:...) form"),
    ("archon:(attn:d2e2|ffn:e2)", "'e' is not allowed in the attn section"),
    ("archon:(attn:d2|ffn:c2)", "'c' is not allowed in the ffn section"),
    ("archon:(attn:d2p2|ffn:p4e2)", "pipeline size differs"),
    ("archon:(attn:d2t3|ffn:e4)", "cannot be derived"),
    ("archon:(attn:d4|ffn:d2e4)", "world sizes differ"),
    ("archon:(ffn:e2|attn:d2)", "wrong place"),
    ("archon:(attn:d2|ffn:e2", "close the hybrid form"),
    ("archon:(attn:d2)", "expected '|'"),
    ("archon:(mlp:d2|ffn:e2)", "expected section 'attn:'"),
    ("archon:d2|t2", "unexpected '|t2'"),
    ("archon:d2)", "unexpected ')'"),
    ("archon:d4+", "expected a backend name"),
    ("sglang:d2+sglang:d2", "both components are inference backends"),
    ("archon:d2+fsdp:d2", "both components are training backends"),
    ("sglang[a]:d2+archon:d2+archon[c]:d2", "every one needs a name"),
    ("sglang[a]:d2+archon[a]:d2", "the name 'a' is used twice"),
    ("sglang[]:d2", "expected a component name"),
    ("sglang[x:d2", "close the name with ']'"),
]


@pytest.mark.parametrize("text, fragment", BAD, ids=[b[0] or "<empty>" for b in BAD])
def test_bad_strings_raise_clear_errors(text, fragment):
    with pytest.raises(AllocationError) as info:
        AllocationMode.from_str(text)
    msg = str(info.value)
    assert fragment in msg
    if text.strip():
        assert f"'{text}'" in msg  # quotes the whole string
    assert "\n" not in msg and "Traceback" not in msg
    assert isinstance(info.value, ValueError)


def test_model_allocation_rejects_chains_and_non_strings():
    with pytest.raises(AllocationError, match="2 components joined by '\\+'"):
        ModelAllocation.from_str("sglang:d4+archon:d4")
    with pytest.raises(AllocationError, match="must be a string"):
        ModelAllocation.from_str(4)  # type: ignore[arg-type]


def test_allocation_rows():
    header, rows = allocation_rows({"actor": ModelAllocation.from_str("archon:(attn:d1p4t2c2|ffn:d1p4t1e4)")})
    assert header[-1] == "world size"
    assert rows == [("actor", "archon", "archon:(attn:d1p4t2c2|ffn:d1p4t1e4)", "1", "2", "4", "2", "4", "1", "16")]
