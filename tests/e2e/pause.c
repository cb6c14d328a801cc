/* The end-to-end test's stand-in for Kubernetes' pause image binary (k8s.gcr.io/pause):
 * the pod sandbox's process, which only waits. Built with `cc -static` so the image
 * needs no libc; exits on SIGTERM/SIGINT as the real one does. */
#include <signal.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

int main(void) {
    signal(SIGTERM, stop);
    signal(SIGINT, stop);
    for (;;)
        pause();
}
