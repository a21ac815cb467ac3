"""A trainer stand-in for fault tests: consumes batches, saving its loader state each time.

    python consume.py ENDPOINT JOB RANK WORLD STATE_FILE LOG_FILE [EPOCHS] [SPEC_JSON] [PAUSE_MS]

Writes "START epoch step micro" when it (re)starts, then for every batch appends
"epoch step micro crc32 sample_id,..." to LOG_FILE (crc32 of the input_ids and loss_mask
bytes, so an audit can check tokens against the source), then atomically writes the
client's state_dict (position after the batch) to STATE_FILE, like a trainer that
checkpoints after each step. A kill -9 between the two leaves one logged batch that the
restored run legitimately replays. Resumes from STATE_FILE when it exists.
"""

import json
import os
import sys
import time
import zlib

from client import LoaderClient

endpoint, job, rank, world, state_file, log_file = sys.argv[1:7]
epochs = int(sys.argv[7]) if len(sys.argv) > 7 else 1
spec = json.loads(sys.argv[8]) if len(sys.argv) > 8 else None
pause_s = float(sys.argv[9]) / 1000 if len(sys.argv) > 9 else 0.0
client = LoaderClient(
    endpoint, job=job, rank=int(rank), world_size=int(world), spec=spec, epochs=epochs,
    dead_after_s=1.0, timeout_s=60,
)  # fmt: skip
if os.path.exists(state_file):
    with open(state_file) as f:
        client.load_state_dict(json.load(f))
with open(log_file, "a") as log:
    log.write("START {} {} {}\n".format(*client.position))
    log.flush()
    for batch in client:
        crc = zlib.crc32(
            batch.loss_mask.numpy().tobytes(), zlib.crc32(batch.input_ids.numpy().tobytes())
        )
        ids = ",".join(map(str, batch.sample_ids.tolist()))
        log.write(f"{batch.epoch} {batch.step} {batch.micro} {crc} {ids}\n")
        log.flush()
        tmp = state_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(client.state_dict(), f)
        os.replace(tmp, state_file)
        if pause_s:
            time.sleep(pause_s)
