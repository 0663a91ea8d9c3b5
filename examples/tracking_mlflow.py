"""MLflow tracking from a ddptrain run, as in Ray Train's "Using experiment tracking" guide.

Only rank 0 logs: ``setup_mlflow`` gives the other ranks an object that ignores every call, so
the training function is the same on every rank. A tiny regression model, CPU, 2 workers.

    pip install ddptrain[mlflow]
    python examples/tracking_mlflow.py --tracking-uri sqlite:////tmp/mlflow.db
    mlflow ui --backend-store-uri sqlite:////tmp/mlflow.db    # with the full `mlflow` package
"""

import argparse
import os
import tempfile

import torch

import ddptrain as train  # was: import ray.train
import ddptrain.torch  # was: import ray.train.torch
from ddptrain.integrations.mlflow import setup_mlflow  # was: from ray.air.integrations.mlflow ...


def train_func(config):
    mlflow = setup_mlflow(
        config,  # logged as the MLflow run's parameters
        tracking_uri=config["tracking_uri"],
        experiment_name="ddptrain-examples",
        create_experiment_if_not_exists=True,
    )
    torch.manual_seed(0)
    model = ddptrain.torch.prepare_model(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    generator = torch.Generator().manual_seed(train.get_context().get_world_rank())
    x = torch.randn(256, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    for epoch in range(config["epochs"]):
        for batch in range(0, len(x), 32):
            loss = torch.nn.functional.mse_loss(model(x[batch : batch + 32]), y[batch : batch + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        mlflow.log_metric("loss", loss.item(), step=epoch)  # does nothing on rank 1
        train.report({"loss": loss.item(), "epoch": epoch})
    mlflow.end_run()  # marks the run FINISHED


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tracking-uri", default=None, help="default: sqlite:///<a temporary folder>/mlflow.db")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()
    tracking_uri = args.tracking_uri or f"sqlite:///{os.path.join(tempfile.mkdtemp(), 'mlflow.db')}"

    result = ddptrain.torch.TorchTrainer(
        train_func,
        train_loop_config={"lr": 0.05, "epochs": args.epochs, "tracking_uri": tracking_uri},
        scaling_config=train.ScalingConfig(num_workers=args.num_workers),
        run_config=train.RunConfig(storage_path=args.storage_path),
    ).fit()
    print(f"final metrics: {result.metrics}")

    from mlflow.tracking import MlflowClient  # read back what rank 0 logged

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("ddptrain-examples")
    run = client.search_runs([experiment.experiment_id], max_results=1)[0]  # the newest first
    losses = [round(m.value, 4) for m in client.get_metric_history(run.info.run_id, "loss")]
    print(f"MLflow run {run.info.run_name!r} ({run.info.status}) at {tracking_uri}")
    print(f"params: {run.data.params}")
    print(f"loss by epoch: {losses}")


if __name__ == "__main__":
    main()
