// A SIGABRT handler for the processes of a multi-host run other than process 0.
//
// Process 0 hosts JAX's coordination service. When it dies, every other process's
// JAX client polls an error from the closed connection and aborts from a C++ thread
// (LOG(FATAL), then abort()): Python never gets control back. jaxlib takes no Python
// error callback in place of the abort, so this handler, armed by
// spec_decode/distributed.py, looks at the abort instead. If the coordinator no longer
// accepts connections (refused, unreachable, or no answer within the timeout), the
// abort is the lost process 0: the handler writes the run's line to stderr (with the
// number of complete, non-blank lines of the predictions file, when one is set) and
// ends the process with the exit code given (EXIT_HOST_LOST); so does any abort once
// Python has decided to end on a loss (the abort races its exit). Any other abort goes on
// as before: the previous SIGABRT action is restored and the signal raised again, to
// be delivered as the handler returns.
//
// The line is the last thing on stderr: whoever ends the process (this handler, or
// Python through spec_decode_abort_end) first points file descriptor 2 at /dev/null,
// so what JAX's threads log from then on (its abort message races the exit) is dropped,
// then writes the line to a duplicate of the real stderr and exits. Only the first of
// the two writes; the other waits for the exit.
//
// Everything in the handler is async-signal-safe (POSIX): socket, connect, poll,
// getsockopt, close, open, read, write, dup, dup2, nanosleep, pause, sigaction, raise,
// _exit.

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

namespace {

constexpr int kText = 8192;
char g_head[kText];   // the line up to the count (or the whole line without a count)
char g_path[kText];   // the file whose lines are counted; empty: no count
char g_tail[kText];   // the line after the count
sockaddr_storage g_addr;
socklen_t g_addr_len = 0;
int g_timeout_ms = 2000;
int g_exit_code = 75;
volatile sig_atomic_t g_armed = 0;
volatile sig_atomic_t g_decided = 0;  // a loss is already known: no probe
int g_ending = 0;  // set (atomically) by the first to end the process: ClaimTheEnd
struct sigaction g_previous;

// 1 when the coordinator accepts a connection now, 0 when it refuses, cannot be
// reached or does not answer within g_timeout_ms.
int CoordinatorAnswers() {
  int fd = socket(g_addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return 1;  // cannot tell: leave the abort as it was
  int answered = 0;
  if (connect(fd, reinterpret_cast<sockaddr*>(&g_addr), g_addr_len) == 0) {
    answered = 1;
  } else if (errno == EINPROGRESS) {
    pollfd p = {fd, POLLOUT, 0};
    int ready;
    do {
      ready = poll(&p, 1, g_timeout_ms);
    } while (ready < 0 && errno == EINTR);
    if (ready > 0) {
      int error = 0;
      socklen_t len = sizeof(error);
      answered = getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0;
    }
  }
  close(fd);
  return answered;
}

// Complete lines of g_path holding more than whitespace (as Python's bytes.strip()).
long CountLines() {
  int fd = open(g_path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buffer[16384];
  long lines = 0;
  int filled = 0;
  for (;;) {
    ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; ++i) {
      char c = buffer[i];
      if (c == '\n') {
        lines += filled;
        filled = 0;
      } else if (c != ' ' && c != '\t' && c != '\r' && c != '\v' && c != '\f') {
        filled = 1;
      }
    }
  }
  close(fd);
  return lines;
}

int g_out = 2;  // where the line goes: the real stderr

void WriteAll(const char* text, size_t size) {
  while (size > 0) {
    ssize_t n = write(g_out, text, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text += n;
    size -= static_cast<size_t>(n);
  }
}

void WriteText(const char* text) { WriteAll(text, strlen(text)); }

void WriteNumber(long value) {
  char digits[32];
  int i = sizeof(digits);
  do {
    digits[--i] = static_cast<char>('0' + value % 10);
    value /= 10;
  } while (value > 0 && i > 0);
  WriteAll(digits + i, sizeof(digits) - i);
}

// Whether this caller is the first to end the process; a later one waits for its exit.
void ClaimTheEnd() {
  if (__atomic_exchange_n(&g_ending, 1, __ATOMIC_SEQ_CST)) {
    for (;;) pause();
  }
}

// How long the line waits after descriptor 2 is silenced: a thread's write that looked up
// descriptor 2 before the switch still goes to the real stderr (the kernel holds the file
// it found), and one that was preempted or blocked on a full pipe there lands whenever it
// runs again, after the line unless the line waits for it. The test whose thread writes
// without pause (tests/test_host_loss.py) on a 2-core AMD EPYC of family 26 with both
// cores kept busy by two other processes: one write after the line in 2 of 130 exits
// without the wait (and once in the test suite), none in 200 with it.
constexpr long kDrainNanoseconds = 50L * 1000 * 1000;

void Drain() {
  timespec left = {0, kDrainNanoseconds};
  while (nanosleep(&left, &left) != 0 && errno == EINTR) {
  }
}

// Silences file descriptor 2 for every thread, lets writes already under way finish
// (`Drain`), writes the line (after a newline when `newline`, since an abort message may
// end mid-line) to the real stderr and exits.
[[noreturn]] void WriteLineAndExit(bool newline) {
  int real = dup(2);
  int null = open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (real >= 0 && null >= 0 && dup2(null, 2) == 2) {
    g_out = real;
    Drain();
  }
  if (newline) WriteText("\n");
  WriteText(g_head);
  if (g_path[0] != '\0') {
    WriteNumber(CountLines());
    WriteText(g_tail);
  }
  WriteText("\n");
  _exit(g_exit_code);
}

void OnAbort(int signal_number) {
  if (g_armed && (g_decided || !CoordinatorAnswers())) {
    ClaimTheEnd();
    WriteLineAndExit(true);
  }
  // Not ours: the previous action (SIG_DFL, or Python's faulthandler) takes the signal,
  // which stays blocked in this handler and arrives as it returns.
  sigaction(signal_number, &g_previous, nullptr);
  raise(signal_number);
}

void Copy(char* to, const char* from) {
  strncpy(to, from ? from : "", kText - 1);
  to[kText - 1] = '\0';
}

}  // namespace

extern "C" {

// Sets the line: head, then (when path is not empty) the count of path's lines and tail.
void spec_decode_abort_line(const char* head, const char* path, const char* tail) {
  sig_atomic_t armed = g_armed;
  g_armed = 0;  // never half-written text in the handler
  Copy(g_head, head);
  Copy(g_path, path);
  Copy(g_tail, tail);
  g_armed = armed;
}

// Arms the handler for the coordinator at ip (IPv4 or IPv6 text) and port; 0 on
// success, -1 when the address does not parse or the handler cannot be installed.
int spec_decode_abort_arm(const char* ip, int port, int timeout_ms, int exit_code) {
  g_armed = 0;
  sockaddr_storage addr;
  memset(&addr, 0, sizeof(addr));
  socklen_t len;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&addr);
  if (inet_pton(AF_INET, ip, &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, ip, &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in6);
  } else {
    return -1;
  }
  g_addr = addr;
  g_addr_len = len;
  g_timeout_ms = timeout_ms;
  g_exit_code = exit_code;
  struct sigaction action;
  memset(&action, 0, sizeof(action));
  action.sa_handler = OnAbort;
  sigemptyset(&action.sa_mask);
  struct sigaction previous;
  if (sigaction(SIGABRT, &action, &previous) != 0) return -1;
  if (previous.sa_handler != OnAbort) g_previous = previous;
  g_armed = 1;
  return 0;
}

// The process is ending on a loss found elsewhere (a failed collective, the watchdog):
// an abort from now on is part of it and prints the line without probing.
void spec_decode_abort_decided() { g_decided = 1; }

// Ends the process with `line` as the last thing on stderr (WriteLineAndExit); never
// returns. An abort that comes meanwhile waits for this exit (or, having come first,
// ends the process with the line set before, and this call waits).
void spec_decode_abort_end(const char* line) {
  g_decided = 1;
  ClaimTheEnd();
  Copy(g_head, line);
  Copy(g_path, "");
  Copy(g_tail, "");
  WriteLineAndExit(false);
}

// Puts the previous SIGABRT action back.
void spec_decode_abort_disarm() {
  g_armed = 0;
  struct sigaction current;
  if (sigaction(SIGABRT, nullptr, &current) == 0 && current.sa_handler == OnAbort) {
    sigaction(SIGABRT, &g_previous, nullptr);
  }
}

}  // extern "C"
