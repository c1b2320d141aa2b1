"""ds_comet.launch: the ranks of a bare single-node mpirun, taken from the MPI launcher's environment.

(The launchers themselves run in tests/cpu/test_example.py.)
"""

from ds_comet.launch import adopt_mpi_launcher_env

OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29575",
}


def test_ranks_from_open_mpi():
    env = dict(OPEN_MPI)
    found = adopt_mpi_launcher_env(env)
    expected = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29575")
    assert {k: env[k] for k in expected} == expected
    assert found == dict(expected, LOCAL_WORLD_SIZE="2")


def test_ranks_from_hydra_with_the_default_address_and_port():
    env = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    adopt_mpi_launcher_env(env)
    assert (env["RANK"], env["LOCAL_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("0", "0", "127.0.0.1", "29500")


def test_other_launchers_and_multi_node_jobs_are_left_alone():
    env = dict(OPEN_MPI, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")  # the launcher set the ranks itself
    assert not adopt_mpi_launcher_env(env) and env["RANK"] == "0"
    env = dict(OPEN_MPI, OMPI_COMM_WORLD_SIZE="4")  # two of four ranks on this node
    assert not adopt_mpi_launcher_env(env) and "RANK" not in env
    env = {"PATH": "/bin"}
    assert not adopt_mpi_launcher_env(env) and env == {"PATH": "/bin"}
