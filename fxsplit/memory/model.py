"""What a device really needs: parameters, buffers, gradients, optimizer state and activations.

Three modes (the ``mode`` option of :func:`fxsplit.fxsplit` and :func:`fxsplit.plan`):

* ``"inference"`` (default): parameters and buffers, plus the peak of the
  activations a forward keeps alive at once on the device (under
  ``torch.no_grad()``), copies received from other devices included.
* ``"training"``: also a gradient for every trainable parameter (same bytes
  as the parameter), the optimizer's state, and the activations autograd
  saves for backward, at the peak of forward and backward.
* ``"weights"``: parameters and buffers only (budget activations yourself).

What the mode and optimizer charge is :class:`~fxsplit.memory.memspec.MemorySpec`. Activations need shapes:
example inputs (real or meta tensors). Without them only the weights (and, in training, gradients and
optimizer state) are counted, and the plan shows no activation column.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping

from fxsplit.cost.build import GraphCosts
from fxsplit.errors import BudgetError
from fxsplit.gcpause import gc_paused
from fxsplit.memory.lifetimes import ActivationProfile, simulate
from fxsplit.memory.memspec import MemorySpec
from fxsplit.memory.planloads import planning_loads
from fxsplit.memory.wording import COMPONENTS, KEPT, TRANSIENT, advice, first_over, listing, summed
from fxsplit.optimizer import step_types
from fxsplit.options import MODES, OPTIMIZERS
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.refine import device_loads
from fxsplit.planning.plan import Plan
from fxsplit.planning.stagecopies import without_weight_copies
from fxsplit.units import format_size

__all__ = ["COMPONENTS", "MODES", "OPTIMIZERS", "MemoryModel", "MemorySpec", "row_total"]


@dataclass
class MemoryModel:
    """Everything needed to charge a plan's devices, for one traced model.

    Attributes:
        spec: the mode and optimizer.
        costs: the cost model (weights, ops).
        trainable: canonical name -> element count of each trainable parameter the graph reads (empty
            outside training, which alone charges their gradients and optimizer state).
        profile: the activation profile, or None when activations are not counted (mode ``"weights"``, or no
            shapes).
        chunks: micro-batches of a pipeline (1: none); the profile is then that of one micro-batch. In
            training, a fill-drain schedule holds what every micro-batch saved for backward until its backward:
            ``chunks - 1`` more of it on each device, or, under activation checkpointing (``checkpoint`` other
            than ``"never"``), of the stage's inputs only.
        checkpoint: the pipeline's checkpointing policy.
        processes: the stages run one per process under ``torch.distributed.pipelining`` (``PipelineConfig(
            processes=True)``, :func:`fxsplit.pipeline_stages`). Each holds its own copy of every weight its ops
            read: a device's row then counts the copies of weights the plan keeps elsewhere (``"stage_copies"``,
            with their gradients and optimizer state in training), and its activations no per-forward copy of
            them. With ``return_outputs``, the last stage keeps every micro-batch's outputs until the step ends
            and merges them (what ``schedule.step`` returns): its activations count them, twice.
        return_outputs: see ``processes``.
        accumulating: the backward adds each weight's gradient to an existing ``.grad`` (the profile's
            :meth:`~fxsplit.memory.lifetimes.ActivationProfile.accumulating`): with micro-batches, all but the
            first's (whose backward runs with the others' saved tensors held).
    """

    spec: MemorySpec
    costs: GraphCosts
    trainable: Mapping[str, int]
    profile: ActivationProfile | None = None
    chunks: int = 1
    checkpoint: str = "never"
    processes: bool = False
    return_outputs: bool = True
    accumulating: bool = False

    @property
    def _keeps_outputs(self) -> bool:
        return self.processes and self.return_outputs and self.chunks > 1

    @property
    def _held_per_chunk(self) -> bool:
        return self.spec.training and self.profile is not None and self.chunks > 1

    def state_bytes(self, name: str, nbytes: int) -> tuple[int, int]:
        """``(gradient, optimizer state)`` bytes of the weight ``name``."""
        if not self.spec.training or name not in self.trainable:
            return 0, 0
        return nbytes, self.spec.optimizer_bytes(nbytes, self.trainable[name])

    @gc_paused()
    def problem(self) -> PartitionProblem:
        """The partition problem charging everything this mode counts."""
        problem = self.costs.problem
        values = list(problem.values)
        training = self.spec.training
        for weight, index in zip(self.costs.weights, self.costs.weight_values, strict=True):
            if index >= 0:
                charged = weight.nbytes + (sum(self.state_bytes(weight.names[0], weight.nbytes)) if training else 0)
                if values[index].weight != charged:  # else the same value as it is
                    values[index] = values[index]._replace(weight=charged)
        extra: tuple[int, ...] = ()
        transient: tuple[int, ...] = ()
        if self.profile is not None:
            extra, transient = planning_loads(self.planned_profile)
            if self._held_per_chunk and self.checkpoint == "never":
                extra = tuple(e * self.chunks for e in extra)
            if self._keeps_outputs:  # the last stage keeps every micro-batch's outputs, then merges them
                at = {name: i for i, name in enumerate(self.profile.op_names)}
                kept = list(extra)
                for name, nbytes in self._outputs().items():
                    if name in at:
                        kept[at[name]] += (2 * self.chunks - 1) * nbytes
                extra = tuple(kept)
        return dataclasses.replace(problem, values=tuple(values), op_extra=extra, op_transient=transient)

    def usage(self, plan: Plan) -> dict[str, dict[str, int]]:
        """Per device: bytes of each of :data:`COMPONENTS` (activations only when counted) and the total."""
        found = {d: dict.fromkeys(COMPONENTS[:4], 0) for d in plan.devices}
        homes = plan.param_devices
        for weight in [*self.costs.weights, *self.costs.unused]:
            device = homes[weight.names[0]]
            row = found.get(device) or found.setdefault(device, dict.fromkeys(COMPONENTS[:4], 0))
            row["buffers" if weight.is_buffer else "params"] += weight.nbytes
        stepped: dict[str, list[int]] = {}  # device -> the gradient bytes of each tensor stepped there
        if self.spec.training:  # outside training a weight has no gradient nor optimizer state
            weights = self.costs.weights
            read = {w.names[0] for w, index in zip(weights, self.costs.weight_values, strict=True) if index >= 0}
            for weight in [*weights, *self.costs.unused]:
                if weight.names[0] in read:
                    row = found[homes[weight.names[0]]]
                    grads, state = self.state_bytes(weight.names[0], weight.nbytes)
                    row["grads"] += grads
                    row["optimizer"] += state
                    if grads:
                        stepped.setdefault(homes[weight.names[0]], []).append(grads)
        if plan.replicas:
            kinds = {w.names[0]: w.is_buffer for w in self.costs.weights}
            for name, replica in plan.replicas.items():  # a replica is charged on every device that holds it
                for device in replica.devices:
                    row = found.get(device) or found.setdefault(device, dict.fromkeys(COMPONENTS[:4], 0))
                    row["buffers" if kinds.get(name) else "params"] += replica.nbytes
        held = self.stage_copy_bytes(plan) if self.processes else {}
        if self.processes:  # on every device, 0 where none: the row says it counts them
            for device, row in found.items():
                row["stage_copies"] = sum(charged for charged, _ in held.get(device, {}).values())
        if self.spec.training:  # every gradient the device holds, its copies' too, is stepped there
            for device, copies in held.items():
                stepped.setdefault(device, []).extend(grads for _, grads in copies.values() if grads)
            for device, row in found.items():
                sizes = stepped.get(device, [])
                types = step_types(device, stepped, self.processes)
                outputs = self._outputs_at_step() if device == plan.output_device else 0
                outputs += self._received_buffers(plan, device)
                row["optimizer_step"] = self.spec.step_bytes(sum(sizes), sizes, types) + outputs
        if self.profile is not None:
            peaks = self.activation_peaks(plan)
            for device, row in found.items():
                row["activations_peak"] = peaks.get(device, 0)
        for row in found.values():
            row["total"] = row_total(row)
        return found

    def counts(self, plan: Plan) -> str:
        """What ``plan``'s memory rows count, in words: the mode, and in training the optimizer and its step."""
        text = self.spec.describe()
        if self.accumulating:
            text += ", gradients accumulated into .grad"
        if self.spec.training and isinstance(self.spec.optimizer, str):
            settings = self.spec.optimizer_settings
            held = self.stage_copy_bytes(plan) if self.processes else {}
            stepped = [
                d for d, row in plan.memory.items() if row["grads"] or any(g for _, g in held.get(d, {}).values())
            ]
            ways = {settings.implementation_on(step_types(d, stepped, self.processes)) for d in stepped}
            text += "".join(f", {way} step" for way in sorted(ways))
        return text

    def charged_loads(self, plan: Plan) -> dict[str, int]:
        """Device -> the bytes the partitioner charged it for ``plan``'s placement (each stage's own copies of the
        weights it reads included, for stages run one per process)."""
        problem = self.problem()
        if self.processes:
            problem = without_weight_copies(problem, self.costs.weight_values)
        index = {device: k for k, device in enumerate(plan.devices)}
        placed = [index[plan.placement[op.name]] for op in self.costs.ops]
        return dict(zip(plan.devices, device_loads(problem, placed, len(plan.devices)), strict=True))

    def stage_copy_bytes(self, plan: Plan) -> dict[str, dict[str, tuple[int, int]]]:
        """Device -> {weight -> (bytes, gradient bytes)} of the weights its stage holds its own copy of (the plan
        keeps them on another device; :class:`Plan` cuts of kind ``"parameter"``): the bytes with its gradient and
        optimizer state in training."""
        weights = {name: weight for weight in self.costs.weights for name in weight.names}
        found: dict[str, dict[str, tuple[int, int]]] = {}
        for cut in plan.cuts:
            weight = weights.get(cut.producer) if cut.kind == "parameter" else None
            if weight is not None:
                grads, state = self.state_bytes(weight.names[0], weight.nbytes)
                found.setdefault(cut.destination, {})[weight.names[0]] = (weight.nbytes + grads + state, grads)
        return found

    def activation_peaks(self, plan: Plan) -> dict[str, int]:
        """Simulated peak activation bytes of every device under ``plan``."""
        profile = self.profile
        assert profile is not None
        op_devices = [plan.placement[name] for name in profile.op_names]
        inputs = {name: plan.placement.get(name, plan.output_device) for name in profile.inputs}
        weights = {name: plan.param_devices[name] for name in profile.weights}
        replicas = {name: tuple(replica.devices) for name, replica in plan.replicas.items()}
        if self.processes:  # each stage holds its copy: read there without one per forward
            for cut in plan.cuts:
                if cut.kind == "parameter":
                    replicas[cut.producer] = (*replicas.get(cut.producer, ()), cut.destination)
        placed = (op_devices, inputs, plan.output_device, weights, replicas)
        simulated = simulate(self.planned_profile, *placed)
        peaks = {str(d): int(v) for d, v in simulated.peak.items()}
        if self._held_per_chunk:
            first = simulate(profile, *placed) if self.accumulating else simulated  # into no .grad yet
            for device in peaks:
                never = self.checkpoint == "never"
                held = first.saved.get(device, 0) if never else self._stage_inputs(plan, device)
                alone = int(first.peak.get(device, 0)) + (self.chunks - 1) * held
                peaks[device] = max(alone, peaks[device] + (self.chunks - 2) * held) if self.accumulating else alone
        if self._keeps_outputs:  # the outputs of every micro-batch, then their merged copy
            kept = (2 * self.chunks - 1) * sum(self._outputs().values())
            peaks[plan.output_device] = peaks.get(plan.output_device, 0) + kept
        return peaks

    @property
    def planned_profile(self) -> ActivationProfile:
        """The profile plans are charged and simulated by: accumulating into ``.grad`` when :attr:`accumulating`."""
        assert self.profile is not None
        return self.profile.accumulating() if self.accumulating else self.profile

    def _outputs_at_step(self) -> int:
        """Bytes of outputs alive while ``optimizer.step()`` runs: the batch's, which the caller holds (and the
        micro-batches' a multi-process pipeline's last stage keeps, when it returns outputs)."""
        if self.profile is None or (self.processes and not self.return_outputs):
            return 0
        return (2 if self.processes else 1) * self.chunks * sum(self._outputs().values())

    def _received_buffers(self, plan: Plan, device: str) -> int:
        """Bytes a stage of a multi-process pipeline keeps between steps: the buffers it receives inputs into."""
        if not self.processes:
            return 0
        received = (c.nbytes or 0 for c in plan.cuts if c.destination == device and c.kind in ("activation", "input"))
        return self.chunks * sum(received)

    def _outputs(self) -> dict[str, int]:
        """Each value the graph returns -> bytes of the storages it holds for one (micro-)batch, each storage once
        (under the first value that holds it)."""
        profile = self.profile
        assert profile is not None
        seen: set[int] = set()
        found = {}
        for name in profile.outputs:
            info = profile.values.get(name)
            if info is not None:
                found[name] = sum(profile.storage_bytes[k] for k in info.storages if k not in seen)
                seen.update(info.storages)
        return found

    def _stage_inputs(self, plan: Plan, device: str) -> int:
        """Bytes a checkpointed stage keeps per micro-batch: the values it receives and the inputs read there."""
        profile = self.profile
        assert profile is not None
        received = sum(c.nbytes or 0 for c in plan.cuts if c.destination == device and c.kind != "parameter")
        for name in profile.inputs:
            info = profile.values.get(name)
            if info is not None and plan.placement.get(name, plan.output_device) == device:
                received += sum(profile.storage_bytes[k] for k in info.storages)
        return received

    def totals(self, devices: Iterable[str] = ()) -> dict[str, int]:
        """Model-wide bytes of each component, as one device holding the whole model needs them (activations:
        saved plus the largest transient; in training, the optimizer step's temporaries, when ``devices``' kinds
        (default: CUDA) run torch's default step on them). Their sum is :func:`row_total`."""
        totals = dict.fromkeys(COMPONENTS, 0)
        for weight in [*self.costs.weights, *self.costs.unused]:
            totals["buffers" if weight.is_buffer else "params"] += weight.nbytes
        stepped: list[int] = []
        for weight, index in zip(self.costs.weights, self.costs.weight_values, strict=True):
            if index >= 0:  # a weight no op reads gets no gradient, so no optimizer state (as usage() counts)
                grads, state = self.state_bytes(weight.names[0], weight.nbytes)
                totals["grads"] += grads
                totals["optimizer"] += state
                if grads:
                    stepped.append(grads)
        if self.profile is not None:
            extra, transient = planning_loads(self.planned_profile)
            kept = (2 * self.chunks - 1) * sum(self._outputs().values()) if self._keeps_outputs else 0
            totals["activations_peak"] = sum(extra) + max(transient, default=0) + kept
        if self.spec.training:  # as usage() counts a device's step, for one device that steps every gradient
            types = {d.partition(":")[0] for d in devices} or {"cuda"}
            totals["optimizer_step"] = self.spec.step_bytes(sum(stepped), stepped, types) + self._outputs_at_step()
        return totals

    def explain(self, error: BudgetError, budgets: Mapping[str, int]) -> BudgetError:
        """A budget error that says which component of memory does not fit."""
        totals = self.totals(budgets)
        capacity, total = sum(budgets.values()), row_total(totals)
        running = 0
        transient = max(TRANSIENT, key=lambda name: totals.get(name, 0))  # (never both at once: the larger)
        for name in [*(n for n in COMPONENTS if n not in TRANSIENT), transient]:
            running += totals[name]
            if totals[name] and running > capacity:
                return BudgetError(
                    f"with {self.spec.describe()} the model needs {summed(totals)} before splitting, but the "
                    f"budgets add up to {format_size(capacity)}: {first_over(name, totals[name])}; short by "
                    f"{format_size(total - capacity)} ({total - capacity} bytes); {_advice(self.spec, name)}"
                )
        return BudgetError(
            f"{error} (with {self.spec.describe()} a budget holds {self.spec.holds()}; the whole model "
            f"needs {summed(totals)})"
        )

    def over_budget(self, usage: Mapping[str, Mapping[str, int]], budgets: Mapping[str, int]) -> BudgetError:
        """The error for a plan whose simulated use exceeds a budget, naming the component."""
        problems = []
        culprits = []
        for device, row in usage.items():
            budget = budgets.get(device)
            if budget is None or row["total"] <= budget:
                continue
            running, culprit = 0, max(TRANSIENT, key=lambda name: row.get(name, 0))
            for name in KEPT:
                running += row.get(name, 0)
                if running > budget:
                    culprit = name
                    break
            culprits.append(culprit)
            problems.append(
                f"'{device}' needs {format_size(row['total'])} ({listing(row)}) but its budget is "
                f"{format_size(budget)}: {first_over(culprit, row.get(culprit, 0)).replace('them', 'it')}, short by "
                f"{format_size(row['total'] - budget)} ({row['total'] - budget} bytes)"
            )
        return BudgetError(
            f"with {self.spec.describe()} no split fxsplit tried fits; in the last one tried, "
            + "; ".join(problems)
            + f"; {_advice(self.spec, culprits[0] if culprits else 'activations_peak')}"
        )


def row_total(row: Mapping[str, int]) -> int:
    """A memory row's total: what stays (weights, gradients, optimizer state, stage copies), plus the larger of the
    activations peak and the optimizer step's temporaries (the step runs after the backward: never both)."""
    transient = max(row.get("activations_peak", 0), row.get("optimizer_step", 0))
    return sum(n for k, n in row.items() if k not in ("activations_peak", "optimizer_step", "total")) + transient


def _advice(spec: MemorySpec, component: str) -> str:
    """:func:`~fxsplit.memory.wording.advice` on ``component``, naming the optimizer ``spec`` plans for."""
    return advice(component, spec.optimizer) if isinstance(spec.optimizer, str) else advice(component)
