"""The TensorBoard event file of rank 0 (``--tensorboard-dir``), with Megatron-LM's scalar names."""

from __future__ import annotations


class TensorboardLog:
    """Owns one ``torch.utils.tensorboard.SummaryWriter``; turns a metrics line into scalars. Never
    computes a metric: what it writes is what the metrics file holds."""

    SCALARS = {"loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm", "loss_scale": "loss-scale",
               "batch_size": "batch-size", "params_norm": "params-norm",
               "tokens_per_s": "throughput/tokens-per-s",
               "tflops_per_rank": "throughput/tflops-per-rank", "mfu": "throughput/mfu",
               "step_time_s": "iteration-time",
               "valid_loss": "validation/lm loss", "valid_ppl": "validation/lm loss ppl",
               "moe_aux_loss": "load_balancing_loss", "moe_seq_aux_loss": "seq_load_balancing_loss",
               "moe_z_loss": "z_loss", "moe_load_max_over_mean_worst": "moe/load-max-over-mean"}

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=directory, max_queue=1000)

    def log(self, record: dict) -> None:
        step = record["iteration"]
        for key, tag in self.SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and value == value and abs(value) != float("inf"):
                self.writer.add_scalar(tag, value, step)
        for key, value in record.items():  # Megatron's names of the prediction depths' losses
            if key.startswith("mtp_") and key.endswith(" loss"):
                self.writer.add_scalar(key, value, step)
        ranks = record.get("per_rank", [])
        if ranks:
            self.writer.add_scalar("memory/peak-bytes", max(r["peak_mem_bytes"] for r in ranks), step)
            self.writer.add_scalar("memory/model-state-bytes",
                                   max(r["model_state_bytes"] for r in ranks), step)
            for operation in ranks[0]["comm_bytes"]:
                self.writer.add_scalar(f"comm-bytes/{operation}",
                                       sum(r["comm_bytes"][operation] for r in ranks), step)
                self.writer.add_scalar(f"comm-bytes-inter-node/{operation}",
                                       sum(r["comm_bytes_inter_node"][operation] for r in ranks), step)

    def close(self) -> None:
        self.writer.close()
