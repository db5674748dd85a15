// hello_device: open a device, plan its arena, move data through it on two streams ordered by
// an event, and print what the allocator saw. Runs on the cpu backend anywhere; pass "cuda"
// as the first argument to use a GPU.
#include <strata/alloc.hpp>
#include <strata/device.hpp>
#include <strata/options.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

int fail(const strata::Status& s) {
  std::fprintf(stderr, "hello_device: %s\n", s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  strata::DeviceConfig cfg;
  if (argc > 1) {
    auto kind = strata::parse_device_kind(argv[1]);
    if (!kind.ok()) return fail(kind.status());
    cfg.kind = *kind;
  }
  cfg.memory_bytes = 64ull << 20;
  cfg.pinned_bytes = 8ull << 20;
  auto device = strata::Device::create(cfg);
  if (!device.ok()) return fail(device.status());
  strata::Device& dev = **device;

  // Parameters live in a planned region; activations in the dynamic part.
  strata::Arena& arena = dev.memory();
  if (auto s = arena.plan({{.name = "params", .bytes = 1 << 20}}); !s.ok()) return fail(s);
  auto params_offset = arena.allocate_persistent("params", 1 << 20);
  if (!params_offset.ok()) return fail(params_offset.status());
  auto* params = static_cast<std::byte*>(arena.base()) + *params_offset;

  auto upload = dev.create_stream("upload");
  auto download = dev.create_stream("download");
  auto uploaded = dev.create_event();
  if (!upload.ok() || !download.ok() || !uploaded.ok()) return fail(strata::internal_error("stream/event creation"));

  const std::size_t n = 1 << 18;
  auto host_in = dev.pinned().allocate(n * sizeof(float), "host_in");
  auto host_out = dev.pinned().allocate(n * sizeof(float), "host_out");
  if (!host_in.ok() || !host_out.ok()) return fail(strata::out_of_memory("pinned buffers"));
  auto* in = static_cast<float*>(host_in->data());
  for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<float>(i) * 0.5f;

  // upload: host -> params; download waits for the upload through the event, then copies back.
  if (auto s = (*upload)->copy_async(params, in, n * sizeof(float), strata::CopyKind::kHostToDevice); !s.ok()) return fail(s);
  if (auto s = (*upload)->record(**uploaded); !s.ok()) return fail(s);
  if (auto s = (*download)->wait(**uploaded); !s.ok()) return fail(s);
  if (auto s = (*download)->copy_async(host_out->data(), params, n * sizeof(float), strata::CopyKind::kDeviceToHost);
      !s.ok()) {
    return fail(s);
  }
  if (auto s = dev.synchronize(); !s.ok()) return fail(s);
  if (std::memcmp(host_in->data(), host_out->data(), n * sizeof(float)) != 0) {
    return fail(strata::data_loss("round trip through device memory changed the data"));
  }

  auto stats = arena.stats();
  std::printf("%s: round trip of %zu floats ok; arena live %llu bytes, reserved %llu bytes\n", dev.info().name.c_str(), n,
              static_cast<unsigned long long>(stats.live_bytes), static_cast<unsigned long long>(stats.reserved_bytes));
  return 0;
}
