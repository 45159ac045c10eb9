"""Target pretraining from scratch: a BPE tokenizer and a Llama/Qwen3 LM trained on a local corpus.

    jspec train target --config configs/code-target.json --out runs/code-target
    jspec train target --mesh data=2,fsdp=4 --config configs/code-target.json --out runs/code-target

Writes the run (checkpoints, metrics.jsonl) under --out and the trained model in Hugging Face format
(config.json, model.safetensors, tokenizer.json) under --out/model. The config is checked whole before
anything runs (jspec.train.runconfig); the run holds --out for its duration (a second run into it is
refused), and tokenizer.json and the model folder are written whole or not at all.
"""

from __future__ import annotations

import logging
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np

from jspec import parallel
from jspec.errors import CheckpointError, ConfigError
from jspec.io.files import read_json_object
from jspec.io.hf import save_params
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.train import data, export, runconfig, runfiles
from jspec.train.export import EOT
from jspec.train.trainer import TrainConfig, Trainer

logger = logging.getLogger(__name__)


def train_tokenizer(vocab_size: int, files: list[str], reserved: tuple[str, ...] = ()):
    """Byte-level BPE whose special tokens are <|endoftext|> (id 0) and then the `reserved` ones (ids 1, 2,
    ...: e.g. the mask token a DFlash-style drafter drafts from, which no text of the corpus becomes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT, *reserved], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    return tok


def lm_loss(params, cfg: ModelConfig, batch: jax.Array):
    """Next-token cross-entropy over windows [B, T + 1]; returns (loss, {'acc'})."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    b, t = inputs.shape
    out = transformer.forward(params, cfg, inputs, jnp.broadcast_to(jnp.arange(t), (b, t)),
                              transformer.KVCache.zeros(cfg, b, t, params["embed"].dtype), kv_chunk=None)
    logits = transformer.logits(params, cfg, out.hidden)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    acc = jnp.mean(jnp.argmax(logits, -1) == labels)
    return jnp.mean(nll), {"acc": acc}


CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def builtin_configs() -> list[str]:
    """The names of the configs shipped with the package (`jspec train --config builtin:NAME`)."""
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json")) if os.path.isdir(CONFIG_DIR) else []


def resolve_config(path: str) -> str:
    """'builtin:NAME' -> the packaged configs/NAME.json (FileNotFoundError listing the names); others unchanged."""
    if not path.startswith("builtin:"):
        return path
    name = path.split(":", 1)[1]
    found = os.path.join(CONFIG_DIR, name + ".json")
    if not os.path.exists(found):
        raise FileNotFoundError(f"no built-in training config {name!r}; built-in configs: {builtin_configs()}")
    return found


def load_run_config(path: str, kind: str | None = None) -> dict:
    """The run config in `path`; with kind ("target" or "drafter") every section's keys and values are
    checked (ConfigError naming the file and each unknown or missing key). 'builtin:NAME' is the config
    of a built-in model shipped with the package (configs/NAME.json: `builtin_configs()`)."""
    path = resolve_config(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no training config at {path!r}: see configs/ for examples, or pass builtin:NAME "
                                f"(one of {builtin_configs()})")
    cfg = read_json_object(path, error=ConfigError)
    if kind is not None:
        runconfig.check_run_config(cfg, path, kind)
    return cfg


def load_run_tokenizer(path: str):
    """The run's tokenizer.json; CheckpointError naming it when it is damaged."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the tokenizers library raises a bare Exception for an unreadable file
        raise CheckpointError(f"{path} is not a valid tokenizer.json ({err}): the file is damaged; delete it to "
                              "train the tokenizer again from the corpus") from err


CORPUS_SOURCES = {"stdlib": data.stdlib_dir, "site-packages": data.site_packages_dir}
"""Named corpus sources of a run config's data.corpus; anything else is a folder."""


def corpus_sources(spec) -> list[tuple[str, str]]:
    """(label, folder) pairs of a run config's data.corpus: a source or a list of sources, each a name of
    CORPUS_SOURCES ("stdlib": the standard library's sources, "site-packages": the installed packages')
    or a folder (labelled by its name)."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    out = [(s, CORPUS_SOURCES[s]()) if s in CORPUS_SOURCES else (os.path.basename(os.path.normpath(s)) or s, s)
           for s in specs]
    labels = [label for label, _ in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"data.corpus {spec!r} names a source twice (labels {labels}): list each folder once")
    return out


def prepare_text(cfg: dict, work_dir: str) -> tuple[str, list[str]]:
    """Build the TFDS corpus; returns (dataset dir, training file paths for the tokenizer)."""
    sources = corpus_sources(cfg["data"]["corpus"])
    pattern = cfg["data"].get("pattern", "**/*.py")
    train = [path for _, path in data.split_sources(sources, pattern)["train"]]
    ds_dir = data.build_corpus(sources, os.path.join(work_dir, "tfds"), pattern)
    return ds_dir, train


def tokenized_windows(tok, ds_dir: str, split: str, seq_len: int, literal_specials: bool = False) -> np.ndarray:
    """The split's documents tokenized and packed into windows of seq_len + 1, joined by <|endoftext|>.

    literal_specials: a special token's text inside a document (a source file that writes "<|mask|>") is
    tokenized as plain text, so that no document yields a special id (a reserved token stays unseen)."""
    saved = tok.encode_special_tokens
    tok.encode_special_tokens = literal_specials
    try:
        docs = [tok.encode(ex["text"]).ids for ex in data.read_split(ds_dir, split)]
    finally:
        tok.encode_special_tokens = saved
    return data.pack_tokens(docs, seq_len, tok.token_to_id(EOT))


def pretrain_target(config_path: str, out_dir: str, *, steps: int | None = None, progress: bool = True,
                    mesh=None, init: str | None = None) -> str:
    """`jspec train target`: a tokenizer and a target trained from a run config; returns the model directory.

    mesh: None (one device) or a jax.sharding.Mesh from jspec.parallel.make_mesh, on which every process
    of the run calls this function: the parameters are placed by jspec.parallel's rules (FSDP over
    `fsdp`, tensor parallel over `model`) and each process loads only the batch rows its devices hold.
    The configuration, fingerprint, batches and outputs do not depend on the mesh, so a run directory
    can be resumed with or without one. With several processes out_dir must be one folder that every
    host sees (checkpoints are written by all processes through orbax); each host builds the text
    corpus in its own subfolder host<i>, and process 0 writes the tokenizer, the metrics and the model.

    init (or "init" in the config's train section; init wins): a Hugging Face model folder (or
    builtin:NAME) that a new run starts from instead of random parameters, and whose tokenizer.json becomes
    the run's; its config and tensors must be the run config's model exactly
    (jspec.train.export.init_target_params). A run folder that has checkpoints resumes from them and
    ignores it, saying so. The init path is not part of the run's fingerprint.
    """
    cfg = load_run_config(config_path, "target")
    config_init = cfg["train"].pop("init", None)  # a start, not a setting: kept out of the fingerprint
    init = init if init is not None else config_init
    with runfiles.locked(out_dir, primary=parallel.is_primary()) as lock:
        return _pretrain(cfg, out_dir, steps, progress, mesh, lock, init)


def check_reserved(tok, reserved: tuple[str, ...], where: str) -> None:
    """CheckpointError unless the run's tokenizer holds the config's reserved tokens at ids 1, 2, ..."""
    ids = [tok.token_to_id(t) for t in reserved]
    if ids != list(range(1, len(reserved) + 1)):
        have = {t: i for t, i in zip(reserved, ids)}
        raise CheckpointError(f"the tokenizer of {where} does not reserve {list(reserved)} at ids 1.."
                              f"{len(reserved)} (it has {have}): reserved_tokens must match the tokenizer the run "
                              "trains with; drop the key, or start a new run in a new --out folder")


def _init_start(cfg: dict, init: str) -> tuple:
    """(tokenizer, parameters) of the init checkpoint, checked against the run config before any corpus is
    read; the parameters come from the file (jspec.train.export.init_target_params)."""
    tok = export.init_tokenizer(init)
    if tok.token_to_id(EOT) is None:
        raise CheckpointError(f"the tokenizer.json of init checkpoint {init!r} has no {EOT} token: a target run "
                              "separates the corpus's documents with it")
    mcfg = export.run_model_config(cfg, tok)
    shapes = jax.eval_shape(lambda: transformer.init_params(mcfg, jax.random.key(0)))
    return tok, export.init_target_params(init, mcfg, shapes)


def _pretrain(cfg: dict, out_dir: str, steps, progress: bool, mesh, lock, init: str | None = None) -> str:
    start_from = None
    reserved = tuple(cfg.get("reserved_tokens", ()))
    if init is not None:
        done = export.checkpoint_steps(out_dir)
        if done:
            if parallel.is_primary():
                logger.warning("target: %s has checkpoints (step %d the newest): the run resumes from them and "
                               "ignores the init checkpoint %r (it starts new runs only)", out_dir, done[-1], init)
        else:
            start_from = _init_start(cfg, init)
    work = out_dir if jax.process_count() == 1 else os.path.join(out_dir, f"host{jax.process_index()}")
    os.makedirs(work, exist_ok=True)
    ds_dir, train_files = prepare_text(cfg, work)
    tok_path = os.path.join(out_dir, "tokenizer.json")
    if parallel.is_primary() and not os.path.exists(tok_path):
        trained = start_from[0] if start_from else train_tokenizer(cfg["model"]["vocab_size"], train_files, reserved)
        runfiles.atomic_file(tok_path, trained.save)
    parallel.sync("tokenizer")
    tok = load_run_tokenizer(tok_path)
    if start_from and tok.get_vocab() != start_from[0].get_vocab():
        raise CheckpointError(f"{tok_path} is not the tokenizer of init checkpoint {init!r}: the run folder began "
                              "another run (that wrote no checkpoint); start from the init checkpoint in a new --out "
                              "folder")
    where = f"init checkpoint {init!r}" if start_from else tok_path
    check_reserved(tok, reserved, where)
    mcfg = export.run_model_config(cfg, tok)
    seq_len, batch = cfg["data"]["seq_len"], cfg["data"]["batch_size"]
    windows = tokenized_windows(tok, ds_dir, "train", seq_len, literal_specials=bool(reserved))
    tc = TrainConfig(**cfg["train"])
    if start_from:
        params = start_from[1]
        if parallel.is_primary():
            logger.info("target: starting from the parameters of %s", init)
    else:
        params = transformer.init_params(mcfg, jax.random.key(tc.seed), std=cfg.get("init_std", 0.02))
    fingerprint = {"kind": "target", "config": cfg}

    def loss(p, b):
        return lm_loss(p, mcfg, b)

    if mesh is None:
        trainer = Trainer(loss, params, tc, out_dir, fingerprint, lock=lock)
        batches = data.batches(windows, batch, tc.seed)
    else:
        params = parallel.shard_params(params, mesh, head_dim=mcfg.head_dim, axes=parallel.target_axes(mcfg))
        parallel.prepare_run_dir(out_dir, fingerprint)
        trainer = Trainer(loss, params, tc, out_dir, fingerprint, sharding=parallel.global_batch(mesh), lock=lock)
        trainer.state = parallel.on_mesh(trainer.state, mesh)
        # Element i of the shuffled stream is window i of the run: the same order as data.batches.
        examples = grain.MapDataset.source(windows).shuffle(seed=tc.seed).repeat()
        batches = parallel.HostLocalBatches(examples, batch, mesh)
    start = trainer.restore_latest()
    if parallel.is_primary():
        where = "" if mesh is None else f" on a {dict(mesh.shape)} mesh of {jax.process_count()} process(es)"
        logger.info("target %.2fM parameters%s, %d training windows of %d%s", mcfg.num_params / 1e6, where,
                    len(windows), seq_len, f"; resuming at step {start}" if start else "")
    state = trainer.run(batches, steps=steps, progress=progress and parallel.is_primary(),
                        metrics_file=parallel.metrics_file(out_dir))
    host_params = parallel.to_host(state.params)  # collective: every process takes part
    model_dir = os.path.join(out_dir, "model")
    if parallel.is_primary():
        def write(folder):
            save_params(folder, mcfg, host_params)
            tok.save(os.path.join(folder, "tokenizer.json"))

        runfiles.replace_folder(model_dir, write)
    parallel.sync("model-saved")
    return model_dir
