#include "harness/harness.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "strata/build_config.hpp"
#if STRATA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

extern char** environ;

namespace strata::testing {

std::filesystem::path temp_root() {
  const char* base = std::getenv("TMPDIR");
  return base && *base ? base : "/tmp";
}

TempDir::TempDir(const std::string& tag) {
  std::string templ = temp_root().string() + "/" + tag + "-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp(" << templ << ") failed";
  }
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

CommandResult run_command(const std::string& command_line) {
  CommandResult r;
  std::string cmd = command_line + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  int status = ::pclose(pipe);
  if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.exit_code = 128 + WTERMSIG(status);
  }
  return r;
}

CommandResult run_cli(const std::string& args) {
  return run_command(std::string(STRATA_CLI_PATH) + " " + args);
}

std::string write_file(const std::filesystem::path& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
  return path.string();
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

const std::vector<std::size_t>& awkward_sizes() {
  static const std::vector<std::size_t> sizes = {0, 1, 3, 15, 17, 255, 1023, 1025, 4095, 4097, 65537, (1u << 20) + 3};
  return sizes;
}

std::vector<std::string> clear_strata_environment() {
  // Names a test deliberately passes to a child it runs (STRATA_TEST_KEEP=STRATA_A,STRATA_B).
  std::string keep = ",";
  if (const char* k = std::getenv("STRATA_TEST_KEEP")) keep += std::string(k) + ",";
  std::vector<std::string> names;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (entry.rfind("STRATA_", 0) != 0) continue;
    const std::string name = entry.substr(0, entry.find('='));
    if (name == "STRATA_TEST_KEEP" || keep.find("," + name + ",") == std::string::npos) names.push_back(name);
  }
  for (const auto& n : names) ::unsetenv(n.c_str());
  return names;
}

namespace {

std::string errno_reason(const char* what, int err) {
  return std::string(what) + " failed: " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
}

}  // namespace

std::string io_uring_unavailable_reason() {
  static const std::string reason = [] {
    io_uring_params params;
    std::memset(&params, 0, sizeof params);
    const long fd = ::syscall(__NR_io_uring_setup, 1, &params);
    if (fd < 0) {
      const int err = errno;
      std::string why = errno_reason("io_uring_setup", err);
      std::ifstream disabled("/proc/sys/kernel/io_uring_disabled");
      int level = 0;
      if (disabled >> level && level != 0) why += "; kernel.io_uring_disabled = " + std::to_string(level);
      return why + ": io_uring is blocked here (seccomp filter, container policy or kernel setting)";
    }
    ::close(static_cast<int>(fd));
    return std::string();
  }();
  return reason;
}

std::string libaio_unavailable_reason() {
  static const std::string reason = [] {
    aio_context_t ctx = 0;
    if (::syscall(__NR_io_setup, 1, &ctx) != 0) {
      return errno_reason("io_setup", errno) + ": Linux AIO is blocked or exhausted here (fs.aio-max-nr)";
    }
    ::syscall(__NR_io_destroy, ctx);
    return std::string();
  }();
  return reason;
}

std::string o_direct_unsupported_reason(const std::filesystem::path& dir) {
  static std::mutex mu;
  static std::map<std::string, std::string> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dir.string());
  if (it != cache.end()) return it->second;
  std::string reason;
  std::string path = (dir / ("strata-odirect-probe-" + std::to_string(::getpid()))).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    reason = errno_reason(("open(O_DIRECT) in " + dir.string()).c_str(), errno);
  } else {
    void* block = nullptr;
    if (::posix_memalign(&block, 4096, 4096) != 0) {
      reason = "posix_memalign failed";
    } else {
      std::memset(block, 0, 4096);
      if (::pwrite(fd, block, 4096, 0) != 4096) {
        reason = errno_reason(("an O_DIRECT write in " + dir.string()).c_str(), errno);
      }
      std::free(block);
    }
    ::close(fd);
    ::unlink(path.c_str());
  }
  if (!reason.empty()) reason += ": the file system does not support O_DIRECT";
  cache[dir.string()] = reason;
  return reason;
}

namespace {
bool g_gpu_required = false;
}

bool gpu_required() { return g_gpu_required; }
void set_gpu_required(bool required) { g_gpu_required = required; }

GpuProbe probe_gpu() {
  static const GpuProbe probe = [] {
    GpuProbe p;
#if !STRATA_HAVE_CUDA
    p.reason = "this build of Strata has no CUDA";
#else
    // Without the driver library the machine has no NVIDIA GPU at all; the runtime would report
    // that as cudaErrorInsufficientDriver, the same code as a driver that is merely too old.
    void* driver = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (driver == nullptr) {
      p.reason = "no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)";
      return p;
    }
    ::dlclose(driver);
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err == cudaErrorNoDevice || (err == cudaSuccess && count == 0)) {
      cudaGetLastError();
      p.reason = "the NVIDIA driver reports no CUDA device";
    } else if (err != cudaSuccess) {
      cudaGetLastError();
      p.state = GpuState::kBroken;
      p.reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
    } else {
      p.state = GpuState::kPresent;
    }
#endif
    return p;
  }();
  return probe;
}

}  // namespace strata::testing
