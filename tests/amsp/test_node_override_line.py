"""amsp.ranks_per_node other than the launch's ranks per machine is said at startup: the launch line gave the
launcher's count ("4 per node") and the engine's the emulated one ("2 per node"), with nothing saying why."""
from omegaconf import OmegaConf

from amsp.build import describe_node_override
from amsp.launch import DistEnv


def test_an_emulated_node_size_is_said_and_the_launchers_is_not_repeated():
    denv = DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4, launcher="torchrun")
    line = describe_node_override(OmegaConf.create({"ranks_per_node": 2}), denv)
    assert line == ("nodes: amsp.ranks_per_node=2: every 2 rank(s) are one node for the plan and the collectives "
                    "(2 nodes), not the launch's 4 per machine"), line
    for same in (None, 4):
        assert describe_node_override(OmegaConf.create({"ranks_per_node": same}), denv) is None
