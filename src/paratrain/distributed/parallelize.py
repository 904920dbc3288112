"""The one place that composes the parallelisms, in a fixed order, and checks a layout first.

Order (as torchtitan composes them; each step says why it comes where it does):

1. pipeline split (``apply_pp``, when ``pp > 1``): first, because every later step works on the
   stage's own module, as if it were a whole model.
2. tensor parallel (``apply_tp``): it replaces parameters by DTensors sharded over the ``tp``
   mesh and installs the layout hooks; every later wrapper must see those final parameters and
   the module names the plan refers to (wrappers rename modules). Then context parallel
   (``apply_cp``): it gives the attention modules the ring attention, before AC and compile wrap
   them, so that both replay and trace the ring.
3. activation checkpointing (``apply_ac``): wraps each block *with* its TP hooks inside, so the
   recomputation replays the TP collectives too; it must come before FSDP so that FSDP's
   per-block unit is the checkpointed block (its all-gather runs again in the recomputation).
4. compile (``apply_compile``, per block): after TP and AC, so it traces the sharded,
   checkpointed blocks; before FSDP so that FSDP's hooks stay outside the compiled regions.
   Then expert parallel (``apply_ep``): each rank keeps its experts, before the data-parallel
   wrappers, which leave them out; with FSDP2 the experts get their own units over the
   ``ep_replicate`` ranks first (``apply_expert_fsdp``, the same mixed precision).
5. FSDP / HSDP (``apply_fsdp``): shards whatever parameters the steps above left, on the
   ``dp_shard`` (or ``dp_replicate x dp_shard``) mesh; with TP its parameters become 2-D DTensors.
   With ``cp > 1`` on ``dp_shard x cp`` flattened (see distributed/context_parallel.py).
6. DDP (``apply_ddp``): last, as it wraps the finished module and buckets its gradients; used
   for ``dp_replicate`` alone (with ``dp_shard > 1`` FSDP2's HSDP does the replication, with
   ``tp > 1`` torch's FSDP2-based ``replicate``, as DDP cannot hold DTensor parameters).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from paratrain.config import CommConfig, ConfigError, ParallelConfig, PrecisionConfig
from paratrain.distributed.activation_checkpoint import apply_ac
from paratrain.distributed.blocks import BLOCKS_ATTR
from paratrain.distributed.compile import apply_compile
from paratrain.distributed.context_parallel import apply_cp
from paratrain.distributed.data_parallel import apply_ddp, apply_fsdp, apply_replicate
from paratrain.distributed.expert_parallel import ExpertGroup, apply_ep, apply_expert_fsdp
from paratrain.distributed.layout_checks import check_parallel_layout as check_parallel_layout  # its old home
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.pipeline_parallel import ZERO_BUBBLE, apply_pp, is_pipeline_stage
from paratrain.distributed.tensor_parallel import apply_tp
from paratrain.precision import build_mp_policy


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    cfg: ParallelConfig,
    device: torch.device,
    spec=None,
    comm: CommConfig | None = None,
    precision: PrecisionConfig | None = None,
    compile_enabled: bool = False,
    loss_parallel: bool = False,
    loss_owns_head: bool = False,
) -> nn.Module:
    """Move ``model`` to ``device`` and apply the parallelisms its layout asks for, in order.

    ``spec``: the model's ModelSpec (models/spec.py, passed in: distributed/ imports no model);
    this reads its ``blocks_attr`` (where the blocks are), ``tp_plan`` (its own tensor-parallel
    plan) and ``cp_attention`` (its installer of a context-parallel attention). None: a plain
    module under the documented conventions (blocks in ``model.layers``, no plan of its own).
    ``cfg``/``comm``/``precision``: the config's sections; ``precision``/``comm`` give FSDP2 its
    MixedPrecisionPolicy (without FSDP2, autocast in the step does the casting and DDP's
    communication hooks the compression). ``loss_parallel``: keep the GPT's logits
    vocabulary-sharded for the loss (tensor_parallel.loss_parallel_enabled decides it; the step
    must then run the loss under loss_parallel). ``loss_owns_head``: the loss runs the output
    layer after the forward (loss.chunk_size), so FSDP2 keeps the root's parameters gathered
    until the backward.
    """
    # Every option, as given: a pipeline stage is parallelized exactly as a whole model would be
    # (e.g. the stage that holds the output layer keeps it gathered for a loss that reads it
    # after the forward, loss_owns_head), with no keyword list to keep in step by hand.
    options = {k: v for k, v in locals().items() if k not in ("model", "dims")}
    comm, precision = comm or CommConfig(), precision or PrecisionConfig()
    blocks_attr = spec.blocks_attr if spec is not None else BLOCKS_ATTR
    # 1. Pipeline split, still on the CPU (only this rank's stages reach the device): each stage
    #    then goes through steps 2-6 like a whole model (this function again), before the
    #    PipelineStage wraps it.
    if dims.pp > 1 and not is_pipeline_stage(model):
        return apply_pp(
            model,
            dims.submesh("pp"),
            cfg=cfg,
            device=device,
            parallelize_stage=lambda stage: parallelize(stage, dims, **options),
            blocks_attr=blocks_attr,
        )
    # Only move what is elsewhere: Module.to cannot swap the fake tensors of the memory
    # estimator (paratrain.batch) in torch 2.13, and they already sit on the device.
    # A model on the meta device stays there: its spec materialises it after this function
    # (ModelSpec.materialize, e.g. pretrained weights read shard by shard).
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device != device for t in tensors) and not all(t.is_meta for t in tensors):
        model.to(device)
    if dims.tp > 1 and dims.dp > 1:
        # On 2-D (dp x tp) meshes DTensor logs, per rank, that the global gradient norm and the
        # full-weights gather take two collectives instead of one: a known, accepted cost here.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    # 2. Tensor (and sequence) parallel: final parameters and module names for all that follows.
    if dims.tp > 1:
        apply_tp(
            model,
            dims.submesh("tp"),
            plan=cfg.tp_plan,
            plan_factory=cfg.tp_plan_factory,
            sequence_parallel=cfg.sequence_parallel,
            loss_parallel=loss_parallel,
            model_plan=spec.tp_plan if spec is not None else None,
        )

    # 2b. Context parallel: the attention modules get the ring attention over the cp mesh.
    if dims.cp > 1:
        install = spec.cp_attention if spec is not None else None
        apply_cp(model, dims.submesh("cp"), install=install, attention=cfg.cp_attention)

    # 3. Activation checkpointing, per block, with the TP hooks inside the recomputed region.
    apply_ac(model, mode=cfg.activation_checkpointing, blocks_attr=blocks_attr)

    # 4. torch.compile, per block: after TP and AC, before the data-parallel wrappers.
    if compile_enabled:
        if dims.pp > 1 and cfg.pp_schedule in ZERO_BUBBLE:
            # Zero-bubble schedules run each backward in two passes (inputs, then weights, with
            # retain_graph=True), which a compiled backward that donates its saved buffers
            # refuses; keep the buffers (a little more memory) for this process's compiles.
            torch._functorch.config.donated_buffer = False
        apply_compile(model, device=device, blocks_attr=blocks_attr)

    # 4b. Expert parallel: keep this rank's experts only, before the data-parallel wrappers,
    #     which leave those weights out (distributed/expert_parallel.py).
    if dims.ep > 1:
        mesh = dims.ep_mesh
        replicas = mesh["ep_replicate"].get_group() if dims.dp > dims.ep else None
        ep = ExpertGroup(mesh["ep"].get_group(), mesh["ep"].get_local_rank(), dims.ep, replicas, dims.dp)
        # Under pp a stage may hold no MoE block (Qwen3-MoE's dense layers): its ep group, the
        # stage's own dp ranks, then has nothing to exchange, on all of its ranks alike.
        if not apply_ep(model, ep) and dims.pp == 1:
            raise ConfigError("parallel.ep > 1 needs a mixture-of-experts model (model.args.moe); set parallel.ep = 1")
        if dims.fsdp_enabled:
            # FSDP2 of the experts over what remains of dp (ep_replicate), with the same mixed
            # precision as the rest; the model's own FSDP2 below then leaves them alone.
            apply_expert_fsdp(
                model,
                mesh["ep_replicate"],
                mp_policy=build_mp_policy(precision, compression=comm.compression) or MixedPrecisionPolicy(),
                reshard_after_forward=cfg.reshard_after_forward,
                divide_factor=dims.dp,
            )

    # 5. Sharded data parallel (ZeRO via FSDP2; HSDP when dp_replicate > 1 too; over dp_shard x cp
    #    when cp > 1, the "fsdp" sub-mesh).
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.submesh("fsdp"),
            reshard_after_forward=cfg.reshard_after_forward,
            cpu_offload=cfg.cpu_offload,
            mp_policy=build_mp_policy(precision, compression=comm.compression),
            blocks_attr=blocks_attr,
            keep_root_unsharded=loss_owns_head,
        )
    # 6. Replicated data parallel, last: it wraps whatever the model has become (not a frozen
    #    one, a preference loss's reference under pp: no gradient to reduce, which DDP refuses).
    elif dims.dp_replicate > 1 and any(p.requires_grad for p in model.parameters()):
        if dims.tp > 1:
            # DDP cannot bucket DTensor parameters: FSDP2's replicate all-reduces TP shards.
            apply_replicate(model, dims.submesh("dp_replicate"), blocks_attr=blocks_attr)
        else:
            model = apply_ddp(model, dims.submesh("dp_replicate"), device=device, bucket_mb=comm.bucket_mb)
    return model
