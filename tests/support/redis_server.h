// A real redis-server for tests (Debian's redis-server; scripts/install-deps.sh installs it):
// started on a free loopback port without persistence, stopped when destroyed. Tests kill and
// restart it on the same port, pause it (SIGSTOP) and resume it, and send it commands.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kvsnap::testing {

class RedisServer {
 public:
  struct Options {
    std::string password;             // requirepass, when not empty
    std::vector<std::string> config;  // more "--name value" arguments
  };

  explicit RedisServer(Options options = {}) : options_(std::move(options)), port_(free_port()) {
    start();
  }
  ~RedisServer() { stop(); }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  int port() const { return port_; }
  // redis://[:password@]127.0.0.1:port[/database]
  std::string address(int database = 0) const {
    std::string out = "redis://";
    if (!options_.password.empty()) out += ":" + options_.password + "@";
    out += "127.0.0.1:" + std::to_string(port_);
    if (database != 0) out += "/" + std::to_string(database);
    return out;
  }

  // Starts the server (again, on the same port) and waits until it answers.
  void start() {
    stop();
    // Everything the child needs is made before fork: other threads may hold malloc's lock.
    const std::string program = find_program("redis-server");
    std::vector<std::string> args = arguments();
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("RedisServer: fork failed");
    if (pid_ == 0) {
      // A test that dies (a sanitizer's abort) takes its server along, and no server holds the
      // test's output open: ctest would wait for it to close, without a timeout.
      (void)::prctl(PR_SET_PDEATHSIG, SIGKILL);
      const int null = ::open("/dev/null", O_WRONLY);
      if (null >= 0) {
        ::dup2(null, 1);
        ::dup2(null, 2);
      }
      ::execv(program.c_str(), argv.data());
      ::_exit(127);
    }
    for (int attempt = 0; attempt < 500; ++attempt) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error(
            "RedisServer: redis-server exited at start (is it installed? scripts/install-deps.sh "
            "installs it; is port " +
            std::to_string(port_) + " free?)");
      }
      try {
        if (command({"PING"}) == "PONG") return;
      } catch (const std::runtime_error&) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    throw std::runtime_error("RedisServer: redis-server did not answer within 5 s");
  }
  // Kills the server (SIGKILL: it keeps nothing) and waits for it.
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGCONT);
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  void pause() { ::kill(pid_, SIGSTOP); }
  void resume() { ::kill(pid_, SIGCONT); }

  // Sends one command; returns a string, status or integer reply as text, array elements joined
  // by '\n', "(nil)" for nil. Throws std::runtime_error when the server cannot be reached or
  // answers with an error.
  std::string command(const std::vector<std::string>& args) const {
    timeval timeout{2, 0};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, timeout);
    if (c == nullptr || c->err != 0) {
      if (c != nullptr) redisFree(c);
      throw std::runtime_error("RedisServer: cannot connect");
    }
    std::string out;
    bool failed = false;
    if (!options_.password.empty()) (void)run(c, {"AUTH", options_.password}, failed);
    if (!failed) out = run(c, args, failed);
    redisFree(c);
    if (failed) throw std::runtime_error("RedisServer: " + args[0] + ": " + out);
    return out;
  }
  std::vector<std::string> keys(const std::string& pattern) const {
    return keys_of({"KEYS", pattern});
  }
  // An array reply's elements.
  std::vector<std::string> keys_of(const std::vector<std::string>& args) const {
    std::vector<std::string> out;
    const std::string all = command(args);
    for (size_t at = 0; at < all.size();) {
      const size_t end = std::min(all.find('\n', at), all.size());
      out.push_back(all.substr(at, end - at));
      at = end + 1;
    }
    return out;
  }
  int64_t info(const std::string& field) const {
    const std::string text = command({"INFO", "all"});
    const size_t at = text.find("\n" + field + ":");
    if (at == std::string::npos) throw std::runtime_error("RedisServer: no INFO field " + field);
    return std::stoll(text.substr(at + field.size() + 2));
  }

 private:
  static int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      ::close(fd);
      throw std::runtime_error("RedisServer: no free port");
    }
    ::close(fd);
    return ntohs(address.sin_port);
  }

  static std::string find_program(const std::string& name) {
    const char* path = std::getenv("PATH");
    std::string folders = path != nullptr ? path : "/usr/bin:/bin";
    for (size_t at = 0; at <= folders.size();) {
      const size_t end = std::min(folders.find(':', at), folders.size());
      const std::string candidate = folders.substr(at, end - at) + "/" + name;
      if (::access(candidate.c_str(), X_OK) == 0) return candidate;
      at = end + 1;
    }
    throw std::runtime_error("RedisServer: " + name +
                             " is not on PATH (scripts/install-deps.sh installs it)");
  }

  std::vector<std::string> arguments() const {
    std::vector<std::string> args = {"redis-server",
                                     "--port",
                                     std::to_string(port_),
                                     "--bind",
                                     "127.0.0.1",
                                     "--save",
                                     "",
                                     "--appendonly",
                                     "no",
                                     "--dir",
                                     "/tmp",
                                     "--loglevel",
                                     "warning"};
    if (!options_.password.empty()) args.insert(args.end(), {"--requirepass", options_.password});
    args.insert(args.end(), options_.config.begin(), options_.config.end());
    return args;
  }

  static std::string run(redisContext* c, const std::vector<std::string>& args, bool& failed) {
    std::vector<const char*> argv;
    std::vector<size_t> lengths;
    for (const std::string& arg : args) {
      argv.push_back(arg.data());
      lengths.push_back(arg.size());
    }
    auto* reply = static_cast<redisReply*>(
        redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lengths.data()));
    if (reply == nullptr) {
      failed = true;
      return c->errstr;
    }
    std::string out = text(reply);
    failed = reply->type == REDIS_REPLY_ERROR;
    freeReplyObject(reply);
    return out;
  }
  static std::string text(const redisReply* reply) {
    switch (reply->type) {
      case REDIS_REPLY_INTEGER:
        return std::to_string(reply->integer);
      case REDIS_REPLY_NIL:
        return "(nil)";
      case REDIS_REPLY_ARRAY: {
        std::string out;
        for (size_t i = 0; i < reply->elements; ++i) {
          out += (i > 0 ? "\n" : "") + text(reply->element[i]);
        }
        return out;
      }
      default:
        return std::string(reply->str, reply->len);
    }
  }

  Options options_;
  int port_;
  pid_t pid_ = -1;
};

}  // namespace kvsnap::testing
