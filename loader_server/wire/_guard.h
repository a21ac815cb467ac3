/* SIGBUS-safe access to shared mappings that another process can shrink.
 *
 * Touching a page of a MAP_SHARED file mapping that lies past the file's end raises SIGBUS,
 * which kills the process: a corpus truncated while the daemon copies from it, or a control
 * page truncated by the client that owns it. Code that reads or writes such a mapping runs
 * inside a guard:
 *
 *     guard_frame frame;
 *     guard_active = &frame;
 *     if (sigsetjmp(frame.jump, 0) == 0) {
 *         ... accesses that may fault ...
 *         guard_active = NULL;
 *     } else {
 *         ... frame.addr is the address that faulted; report an error ...
 *     }
 *
 * The handler jumps back to the guard of the faulting thread (guard_active is per thread);
 * a SIGBUS outside any guard is passed to the handler installed before this one (for
 * example Python's faulthandler) and then ends the process as it would have without us.
 * A handler installed after this one (faulthandler.enable() later) runs first: it prints
 * its traceback, restores this one and re-raises, and the guard still catches the fault. The
 * handler is installed with SA_NODEFER, so leaving it by siglongjmp without restoring the
 * signal mask (sigsetjmp(..., 0): no system call per guard) leaves SIGBUS deliverable.
 *
 * Each extension module that includes this header installs its own handler, which chains
 * to the previous one: a fault inside another module's guard reaches that module's handler.
 */
#ifndef DFLASH_GUARD_H
#define DFLASH_GUARD_H

#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>

typedef struct {
    sigjmp_buf jump;
    void *volatile addr;
} guard_frame;

/* initial-exec: the handler must not allocate a thread's TLS block on first use. */
static __thread guard_frame *volatile guard_active __attribute__((tls_model("initial-exec")));
static struct sigaction guard_previous;
static int guard_installed;

static void guard_handler(int sig, siginfo_t *info, void *context) {
    guard_frame *frame = guard_active;
    if (frame != NULL) {
        guard_active = NULL;
        frame->addr = info->si_addr;
        siglongjmp(frame->jump, 1);
    }
    /* Not ours: the previous handler has its turn (Python's faulthandler prints a
     * traceback); if it returns, the default action: the repeated access ends the process
     * exactly as it would have without this handler. */
    if (guard_previous.sa_flags & SA_SIGINFO) {
        if (guard_previous.sa_sigaction != NULL) guard_previous.sa_sigaction(sig, info, context);
    } else if (guard_previous.sa_handler != SIG_DFL && guard_previous.sa_handler != SIG_IGN) {
        guard_previous.sa_handler(sig);
    }
    signal(sig, SIG_DFL);
}

/* Install the handler once per module; -1 with errno set on failure. */
static int guard_install(void) {
    if (guard_installed) return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = guard_handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &guard_previous) != 0) return -1;
    guard_installed = 1;
    return 0;
}

#endif
