from specdec.train.cli import main

if __name__ == "__main__":
    main()
