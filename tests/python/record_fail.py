"""A rank that fails under torch's `@record` (tests/lab_torchrun.rs): the rank with RANK=1
raises in `deepest_frame_qz` once the others are up; the others wait a little and exit 0.
Run under torchrun and under `meshd run` to compare the error file and the root cause."""
import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


def deepest_frame_qz():
    raise ValueError("boom-5e2a on rank " + os.environ["RANK"])


@record
def main():
    if os.environ["RANK"] == "1":
        time.sleep(1)
        deepest_frame_qz()
    time.sleep(4)


if __name__ == "__main__":
    main()
