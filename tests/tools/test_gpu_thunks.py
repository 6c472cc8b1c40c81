"""benchmarks/gpu_thunks.py: the host's launches of a compiled GPU step, read from XLA's dumped
thunk sequence (command buffers, what stays outside them, conditionals and loops)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_thunks  # noqa: E402

# The shape XLA writes (jaxlib 0.10.2): two command buffers around a custom call that is not
# command-buffer compatible, a conditional whose branches differ in launches, a loop whose
# `condition:` label XLA prints at column 0, a copy outside.
DUMP = """\
000: kCommandBuffer [source       | next=003 (1)] 
    001: kCustomKernel [source       | next=002 (1)] gemm_fusion_dot grid: [512, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
    002: kCopy         [prev=001 (1) | sink        ] kCopy
003: kCustomCall    [prev=000 (1) | next=000 (1)] kCustomCall
000: kCommandBuffer [prev=003 (1) | next=010 (1)] 
    004: kCustomKernel [source       | sink        ] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
010: kConditional   [prev=000 (1) | next=020 (1)]   
  false_branch:
    005: kCustomKernel [source       | next=006 (1)] input_reduce_fusion grid: [1, 1, 1] threads: [2, 1, 1]  shared_memory: 0 bytes
    006: kCustomKernel [prev=005 (1) | next=009 (1)] loop_select_fusion grid: [1002, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    009: kWhile         [prev=006 (1) | sink        ]   
condition:
        007: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        000: kCommandBuffer [source | sink] 
            008: kCustomKernel [source | sink] sort_1 grid: [2, 1, 1] threads: [1024, 1, 1]  shared_memory: 0 bytes
  true_branch:
    011: kCopy [source | sink] kCopy
020: kCopy          [prev=010 (1) | sink        ] kCopy
"""


def test_the_host_launches_of_a_dumped_step():
    s = gpu_thunks.summarize(DUMP)
    assert s["command_buffers"] == 2 and s["kernels_in_command_buffers"] == 2
    assert s["outside"] == {"kConditional": 1, "kCopy": 1, "kCustomCall": 1}
    assert s["conditionals"] == 1
    # plain: 5 top-level thunks + the copy branch (1); heavy: + 2 kernels + the loop (1) with
    # its condition (1) and body (a command buffer, 1)
    assert s["host_launches"] == 6
    assert s["host_launches_heavy"] == 5 + 5


def test_the_tree_keeps_branches_and_the_loops_condition_under_their_thunk():
    roots = gpu_thunks.parse(DUMP)
    assert [t.kind for t in roots] == [
        "kCommandBuffer", "kCustomCall", "kCommandBuffer", "kConditional", "kCopy"]
    cond = roots[3]
    assert [b.line for b in cond.children] == ["false_branch:", "true_branch:"]
    loop = cond.children[0].children[2]
    assert loop.kind == "kWhile"
    assert [b.line for b in loop.children] == ["condition:", "body:"]


def test_read_dump_prefers_the_sequence_after_the_thunk_passes(tmp_path):
    assert gpu_thunks.read_dump(tmp_path) is None  # nothing dumped: not a GPU compile
    (tmp_path / "module_0001.jit_f.thunk_sequence.txt").write_text("001: kCopy [source | sink] kCopy\n")
    assert gpu_thunks.read_dump(tmp_path)["command_buffers"] == 0
    (tmp_path / "module_0001.jit_f.thunk_sequence_after_thunk_passes.txt").write_text(DUMP)
    assert gpu_thunks.read_dump(tmp_path)["command_buffers"] == 2
