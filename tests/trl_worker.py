"""One process of `accelerate launch --num_processes 2 tests/trl_worker.py OUT [URL]`
(tests/test_trl.py): the tiny TonpGRPOTrainer run over DDP (gloo, CPU); each process writes
OUT/rank<r>.json with its rollouts (prompt and completion ids per generation call), its final
parameters' checksum and, on rank 0, TRL's log_history."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_utils import make_trainer, tiny_policy  # noqa: E402

from tonp_models.integrations.trl import TonpGRPOTrainer  # noqa: E402


class Recording(TonpGRPOTrainer):
    rollouts = []

    def _generate_single_turn(self, prompt_ids, *a, **kw):
        completions, logprobs = super()._generate_single_turn(prompt_ids, *a, **kw)
        self.rollouts.append([[list(p), list(c)] for p, c in zip(prompt_ids, completions)])
        return completions, logprobs


def main(out, url=None):
    model, w0 = tiny_policy()
    trainer = make_trainer(model, os.path.join(out, "run"), generator=url, batch=2,
                           trainer_cls=Recording)
    trainer.train()
    rank = trainer.accelerator.process_index
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    changed = any(not torch.equal(w0[k], v) for k, v in model.named_parameters())
    res = dict(rank=rank, world=trainer.accelerator.num_processes, rollouts=trainer.rollouts,
               changed=changed, weight_version=trainer.tonp_generator.weight_version,
               log_history=trainer.state.log_history if rank == 0 else None)
    torch.save(flat, os.path.join(out, f"weights{rank}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    # Both ranks done before either tears gloo down: a rank that exited with the group alive
    # once aborted in its teardown ("terminate called without an active exception", SIGABRT
    # after its results were written; 1 run in the full suite at db562da, 0 of 3 alone).
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
