import time, sys
end = time.time() + float(sys.argv[1])
while time.time() < end:
    t = time.time() + 20
    while time.time() < t:
        sum(i * i for i in range(10000))
    time.sleep(20)
