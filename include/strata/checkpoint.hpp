// Checkpoints: the complete training state on disk, published atomically.
//
// A checkpoint root directory holds published checkpoints and a pointer to the newest:
//
//   ROOT/latest                   the name of the newest published checkpoint, one line
//   ROOT/step-00000012/           a published checkpoint: its files, then manifest.json
//   ROOT/step-00000012.tmp-PID/   one being written (never loaded; removed by the next save)
//
// Publishing (publish_checkpoint): the files are written into a .tmp directory, each one
// written to a temporary name, fsync'd and renamed; their sizes and crc32c are read back from
// disk into manifest.json, which is written the same way and last; the directory is fsync'd and
// renamed to its final name, ROOT is fsync'd, and only then is `latest` replaced (temporary
// file, fsync, rename, fsync of ROOT). A crash at any moment therefore leaves `latest` naming a
// complete, verified checkpoint: the new one or the previous one. Older checkpoints beyond
// `keep` are removed after `latest` moves.
//
// Loading (resolve_checkpoint, read_checkpoint_manifest) checks the manifest and every file's
// size and checksum before the caller changes any state, so a corrupt or truncated checkpoint
// is an error naming the file, never a half-loaded model.
//
// What a training checkpoint contains is the engine's business (OffloadEngine::save_checkpoint):
// per parameter, by name, its working copy, fp32 master and both Adam moments, independent of
// where each lived, so a checkpoint loads under any placement.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/status.hpp"

namespace strata {

struct CheckpointFile {
  std::string name;  // relative to the checkpoint directory
  std::uint64_t bytes = 0;
  std::uint32_t crc32c = 0;
};

struct CheckpointManifest {
  std::int64_t step = 0;          // optimizer steps taken when it was saved
  std::string model_config;       // the model config as Hugging Face config.json text
  std::string placement;          // where the state lived when saved (informational)
  std::string client_state = "{}";  // the caller's JSON (data position, run settings, ...)
  std::vector<CheckpointFile> files;
  std::string dir;                // filled on read: the checkpoint directory
};

// Writes a checkpoint for `manifest.step` under `root` (created if missing): calls
// write_files(dir, &names) to write its files into a fresh directory (names relative to it),
// then checksums, publishes and prunes as described above, keeping the newest `keep` (>= 1)
// checkpoints. Returns the published directory. On failure `latest` is untouched.
Result<std::string> publish_checkpoint(
    const std::string& root, CheckpointManifest manifest, int keep,
    const std::function<Status(const std::string& dir, std::vector<std::string>* names)>& write_files);

// A checkpoint directory (one holding manifest.json) is returned as it is; a root is resolved
// through its `latest` file. Errors name the path and list the checkpoints a root holds.
Result<std::string> resolve_checkpoint(const std::string& path);

// Reads dir/manifest.json; with verify, checks that every file exists with its size and crc32c.
Result<CheckpointManifest> read_checkpoint_manifest(const std::string& dir, bool verify = true);

}  // namespace strata
